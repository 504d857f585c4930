#!/bin/bash
# Speculative decoding side by side (issue 27): the default model served by Switchyard without and
# with --speculate, and by llama.cpp's llama-server without and with its n-gram speculation, one
# server at a time (each started, driven by `switchyard bench serve`, stopped), on the grounded
# workload (300-800-token inputs whose answer repeats them; outputs up to OUT_TOKENS, greedy) and
# on the chat workload (short prompts, forced outputs).
#
#   benchmarks/speculate_side_by_side.sh [OUT_DIR]
#
# Env: PEERS ($HOME/.cache/switchyard-peers, where benchmarks/gguf_side_by_side.sh build puts
# llama-server), SPECULATE (5), GROUNDED_C ("1 32"), CHAT_C ("1,8,32"), OUT_TOKENS (256),
# SERVERS ("sy sy-spec llama llama-ngram"), LLAMA_NGRAM ("--spec-type ngram-simple
# --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8 --spec-draft-n-max 5").
# Each run is a JSON line in OUT_DIR/runs.jsonl; Switchyard's acceptance rate is read from its
# /metrics after each run, llama-server's from its log. Benchmark only an idle machine.
set -u
PEERS=${PEERS:-$HOME/.cache/switchyard-peers}
OUT=${1:-benchmarks/results/$(date -u +%Y-%m-%d)-speculate}
SPECULATE=${SPECULATE:-5}
GROUNDED_C=${GROUNDED_C:-"1 32"}
CHAT_C=${CHAT_C:-"1,8,32"}
OUT_TOKENS=${OUT_TOKENS:-256}
SERVERS=${SERVERS:-"sy sy-spec llama llama-ngram"}
LLAMA_NGRAM=${LLAMA_NGRAM:-"--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8 --spec-draft-n-max 5"}
MODEL=$(python3 -c "from switchyard.core.loader import default_model_path; print(default_model_path())")
PORT=8120
mkdir -p "$OUT"
RUNS=$OUT/runs.jsonl

PID=
stop() { [ -n "$PID" ] && { kill $PID 2>/dev/null; wait $PID 2>/dev/null; PID=; }; sleep 2; }
trap stop EXIT

start() {  # label
  local log=$OUT/$1.log
  case $1 in
    sy) switchyard serve --port $PORT --max-batch-total-tokens 16384 > "$log" 2>&1 & ;;
    sy-spec) switchyard serve --port $PORT --max-batch-total-tokens 16384 --speculate $SPECULATE > "$log" 2>&1 & ;;
    llama|llama-ngram)
      local extra=""; [ $1 = llama-ngram ] && extra=$LLAMA_NGRAM
      # -kvu: one unified 16k cache (the grounded prompts do not fit a 512-token slot of 32)
      # shellcheck disable=SC2086
      $PEERS/llama-server-build/bin/llama-server -m "$MODEL" -a smollm2 --host 127.0.0.1 --port $PORT \
        -t 2 -tb 2 -c 16384 -np 32 -cb -kvu --no-webui $extra > "$log" 2>&1 & ;;
  esac
  PID=$!
  for _ in $(seq 600); do
    curl -sf -o /dev/null http://127.0.0.1:$PORT/health && return 0
    kill -0 $PID 2>/dev/null || { echo "$1 died:"; tail -5 "$log"; return 1; }
    sleep 1
  done
  return 1
}

acceptance() {  # label -> one line
  case $1 in
    sy-spec) curl -s http://127.0.0.1:$PORT/metrics | grep -E '^switchyard_spec_(acceptance_rate|proposed_tokens_total|accepted_tokens_total)' | tr '\n' ' ' ;;
    llama-ngram) grep -E 'draft acceptance|n_draft|accepted' "$OUT/$1.log" | tail -1 ;;
  esac
}

for server in $SERVERS; do
  echo "== $server"
  start $server || continue
  for c in $GROUNDED_C; do
    switchyard bench serve --url "$server=http://127.0.0.1:$PORT" --workload grounded --concurrency $c \
      --output-len $OUT_TOKENS --output "$RUNS" 2>&1 | tail -4
  done
  echo "acceptance $server after grounded: $(acceptance $server)" | tee -a "$OUT/acceptance.txt"
  case $server in sy|sy-spec)
    switchyard bench serve --url "$server=http://127.0.0.1:$PORT" --workload chat --concurrency "$CHAT_C" \
      --output "$RUNS" 2>&1 | tail -6
    echo "acceptance $server after chat too: $(acceptance $server)" | tee -a "$OUT/acceptance.txt" ;;
  esac
  stop
done
switchyard bench serve --results "$RUNS"
