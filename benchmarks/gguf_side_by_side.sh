#!/bin/bash
# One GGUF file served by llama.cpp's llama-server and by Switchyard, one after the other (never
# both at once), each driven by the peers' load generator (/work/shared/peers/bench_openai.py),
# with the peak RSS of each server's whole process tree (issue 25).
#
#   benchmarks/gguf_side_by_side.sh build [avx2|avx512]   # llama-server, -quantize, -perplexity; converter + bench venvs
#   benchmarks/gguf_side_by_side.sh FILE.gguf [extra `switchyard serve` args...]
#
# `build` builds llama.cpp for this CPU into $PEERS/llama-server-build; `build avx2` builds it at
# the AVX2 level (no AVX-512, whatever the CPU has) into $PEERS/llama-avx2-build, and `build
# avx512` at the AVX-512 level without VNNI, BF16 or AMX into $PEERS/llama-avx512-build, to compare at
# one ISA level (see /work/shared/peers/README.md). LLAMA_BUILD picks the build folder that
# serves (default $PEERS/llama-server-build), e.g. LLAMA_BUILD=$PEERS/llama-avx2-build.
#
# Rows (ROWS, default "1:8 8:32 32:64 long"): C:N = N requests, C in flight, 128 forced output
# tokens (ignore_eos + min_tokens), the 64 built-in short prompts; "long" = c=1, LONG_N (4)
# requests of ~LONG_TOKENS (1500) prompt tokens each, distinct from their first token, 16
# output tokens, for the time to first token (the server is warmed with short prompts first).
# llama-server: port 8104, -t 2 -tb 2 -c 16384 -np 32 -cb --no-webui (as the peers' start script;
# LLAMA_ARGS adds more). Its 32 slots get 512 tokens each, too few for the long prompts, so the
# long row runs on a second start with -kvu (unified KV: one slot may use all 16384).
# Switchyard: switchyard serve --model-id FILE --port 8110 --max-batch-total-tokens 16384 + args.
# RSS: the sum of VmRSS over the server's process and all its descendants (Switchyard: gateway and
# engine), sampled every 0.5 s; per row (during the row) and over the server's life (load too).
# Each row is appended as a JSON line to RESULTS (default $PEERS/results/gguf_side_by_side.jsonl);
# a table with Switchyard/llama-server ratios is printed at the end.
# Env: PEERS ($HOME/.cache/switchyard-peers), SERVERS ("llama switchyard"), MODE (chat |
# completions), WARMUP (4), OUT_TOKENS (128), SWITCHYARD (switchyard), LLAMA_PORT, SY_PORT,
# BENCH (/work/shared/peers/bench_openai.py), LOAD_TIMEOUT (1200 s).
# Benchmark only an idle machine: llama.cpp's spinning OpenMP threads slow 10x beside other work.
set -u
PEERS=${PEERS:-$HOME/.cache/switchyard-peers}
HERE=$(cd "$(dirname "$0")" && pwd)
V=0.3.36
SRC=$PEERS/src/llama_cpp_python-$V/vendor/llama.cpp
BUILD=${LLAMA_BUILD:-$PEERS/llama-server-build}
BENCH=${BENCH:-$HERE/../../shared/peers/bench_openai.py}  # the peers' load generator, beside the checkout
BPY=$PEERS/bench-venv/bin/python

if [ "${1:-}" = build ]; then
  set -e
  # llama.cpp from the llama-cpp-python sdist, as /work/shared/peers/build_llama_server.sh,
  # plus llama-quantize and llama-perplexity. On AMX CPUs -DGGML_NATIVE=ON builds ggml's AMX path,
  # whose worker threads die with SIGILL on the first request (README): build AVX-512 by name there.
  ISA=${2:-native}
  mkdir -p $PEERS/dl $PEERS/src $PEERS/logs $PEERS/results
  [ -f $PEERS/dl/llama_cpp_python-$V.tar.gz ] || pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==$V -d $PEERS/dl
  [ -d $PEERS/src/llama_cpp_python-$V ] || tar xzf $PEERS/dl/llama_cpp_python-$V.tar.gz -C $PEERS/src
  if [ "$ISA" = avx2 ]; then
    BUILD=$PEERS/llama-avx2-build
    ARCH="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
  elif [ "$ISA" = avx512 ]; then
    BUILD=$PEERS/llama-avx512-build
    ARCH="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  elif [ "$ISA" != native ]; then
    echo "unknown ISA level $ISA (native | avx2 | avx512)"; exit 1
  elif grep -q amx_tile /proc/cpuinfo; then
    BUILD=$PEERS/llama-server-build
    ARCH="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  else
    BUILD=$PEERS/llama-server-build
    ARCH="-DGGML_NATIVE=ON"
  fi
  command -v cmake >/dev/null && command -v ninja >/dev/null || { apt-get update && apt-get install -y cmake ninja-build; }
  # LLAMA_USE_PREBUILT_UI=OFF: the default downloads the web UI from a hub, unreachable here.
  cmake -S $SRC -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release $ARCH -DGGML_CUDA=OFF -DGGML_BLAS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
  nice -n 19 cmake --build $BUILD --target llama-server llama-quantize llama-perplexity -j 2
  $BUILD/bin/llama-server --version
  # the converter imports sentencepiece; torch/transformers come from the system site-packages
  [ -x $PEERS/convert-venv/bin/python ] || { python3 -m venv --system-site-packages $PEERS/convert-venv && $PEERS/convert-venv/bin/pip install sentencepiece; }
  [ -x $BPY ] || { python3 -m venv $PEERS/bench-venv && $PEERS/bench-venv/bin/pip install httpx; }
  exit 0
fi

GGUF=${1:?usage: $0 build [avx2] | $0 FILE.gguf [switchyard serve args...]}
shift
GGUF=$(readlink -f "$GGUF")
# a checkpoint directory (e.g. benchmarks/gptq_models.py's) is served by Switchyard alone (SERVERS=switchyard)
[ -f "$GGUF" ] || [ -d "$GGUF" ] || { echo "no file $GGUF"; exit 1; }
[ -x $BPY ] || { echo "no $BPY: run $0 build"; exit 1; }
SY_ARGS=("$@")
ROWS=${ROWS:-"1:8 8:32 32:64 long"}
SERVERS=${SERVERS:-"llama switchyard"}
MODE=${MODE:-chat}
WARMUP=${WARMUP:-4}
OUT_TOKENS=${OUT_TOKENS:-128}
LONG_N=${LONG_N:-4}
LONG_TOKENS=${LONG_TOKENS:-1500}
LLAMA_PORT=${LLAMA_PORT:-8104}
SY_PORT=${SY_PORT:-8110}
SWITCHYARD=${SWITCHYARD:-switchyard}
LOAD_TIMEOUT=${LOAD_TIMEOUT:-1200}
RESULTS=${RESULTS:-$PEERS/results/gguf_side_by_side.jsonl}
RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)-$$
NAME=$(basename "$GGUF" .gguf)
TMP=$(mktemp -d)
mkdir -p $PEERS/logs "$(dirname "$RESULTS")"
MODEFLAG=(); [ "$MODE" = completions ] && MODEFLAG=(--completions)

# Peak of the summed VmRSS of a process and all its descendants, every 0.5 s, into a JSON file.
RSS_PY='
import json, os, signal, sys, time
root, out = int(sys.argv[1]), sys.argv[2]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
def tree_rss():
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, n, todo = 0, 0, [root]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        n += 1
        except OSError:
            pass
    return total, n
peak, procs, samples = 0, 0, 0
while not stop and os.path.exists(f"/proc/{root}"):
    r, n = tree_rss()
    if r > peak:
        peak, procs = r, n
    samples += 1
    with open(out + ".tmp", "w") as f:
        json.dump({"peak_rss_bytes": peak, "procs_at_peak": procs, "samples": samples}, f)
    os.replace(out + ".tmp", out)
    time.sleep(0.5)
'
rss_start() { python3 -c "$RSS_PY" "$1" "$2" > /dev/null 2>&1 & echo $!; }  # (stdout closed: $(...) must not wait)
rss_stop() { kill "$1" 2>/dev/null; wait "$1" 2>/dev/null; }

SERVER_PID=
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  local kids; kids=$(pgrep -P $SERVER_PID 2>/dev/null)
  kill $SERVER_PID 2>/dev/null
  for _ in $(seq 60); do kill -0 $SERVER_PID 2>/dev/null || break; sleep 0.5; done
  kill -9 $SERVER_PID $kids 2>/dev/null
  wait $SERVER_PID 2>/dev/null
  SERVER_PID=
}
cleanup() { stop_server; [ -n "${LIFE_RSS:-}" ] && rss_stop $LIFE_RSS; rm -rf "$TMP"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_ready() {  # url log
  local t0=$SECONDS
  until curl -sf -o /dev/null "$1"; do
    kill -0 $SERVER_PID 2>/dev/null || { echo "server died; tail of $2:"; tail -20 "$2"; return 1; }
    [ $((SECONDS - t0)) -lt $LOAD_TIMEOUT ] || { echo "not ready after ${LOAD_TIMEOUT}s"; tail -20 "$2"; return 1; }
    sleep 1
  done
  echo "  ready after $((SECONDS - t0)) s"
}

port_free() { ! (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null; }

start_server() {  # which kvu?
  local log=$PEERS/logs/gguf_sbs_$1_$RUN_ID.log
  if [ "$1" = llama ]; then
    port_free $LLAMA_PORT || { echo "port $LLAMA_PORT is in use"; return 1; }
    local extra=(); [ "${2:-}" = kvu ] && extra=(-kvu)
    SERVER_ARGS="-t 2 -tb 2 -c 16384 -np 32 -cb --no-webui ${extra[*]} ${LLAMA_ARGS:-}"
    echo "== llama-server $NAME $SERVER_ARGS (log $log)"
    # shellcheck disable=SC2086
    $BUILD/bin/llama-server -m "$GGUF" -a "$NAME" --host 127.0.0.1 --port $LLAMA_PORT $SERVER_ARGS > "$log" 2>&1 &
    SERVER_PID=$!; BASE=http://127.0.0.1:$LLAMA_PORT
  else
    port_free $SY_PORT || { echo "port $SY_PORT is in use"; return 1; }
    SERVER_ARGS="--max-batch-total-tokens 16384 ${SY_ARGS[*]}"
    echo "== $SWITCHYARD serve --model-id $GGUF $SERVER_ARGS (log $log)"
    $SWITCHYARD serve --model-id "$GGUF" --hostname 127.0.0.1 --port $SY_PORT --max-batch-total-tokens 16384 "${SY_ARGS[@]}" > "$log" 2>&1 &
    SERVER_PID=$!; BASE=http://127.0.0.1:$SY_PORT
  fi
  LOG=$log
  LIFE_RSS=$(rss_start $SERVER_PID $TMP/life_$1.json)
  wait_ready $BASE/health "$log"
}

make_long_prompts() {  # distinct ~LONG_TOKENS-token prompts, one a line, counted with SmolLM2's tokenizer
  python3 - "$TMP/long_prompts.txt" $LONG_N $LONG_TOKENS <<'PY'
import os, random, sys
from transformers import AutoTokenizer
from switchyard.core.loader.source import default_model_path
out, n, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
p = default_model_path()
tok = AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))
words = ("river mountain signal engine garden window paper silver market winter orange basket "
         "thunder lantern harbor violin meadow rocket pencil castle forest bridge candle mirror "
         "planet circus jacket ladder magnet needle pillow rabbit saddle tunnel valley wagon "
         "anchor blossom copper desert falcon glacier hammer island jungle kettle lemon marble").split()
lines = []
for i in range(n):
    rng = random.Random(1000 + i)
    text = f"Report {i}: " + " ".join(rng.choice(words) for _ in range(int(target * 1.2)))
    ids = tok.encode(text, add_special_tokens=False)[:target]
    lines.append(tok.decode(ids).replace("\n", " ") + " Summarize the report.")
    print(f"  long prompt {i}: {len(tok.encode(lines[-1], add_special_tokens=False))} tokens", file=sys.stderr)
open(out, "w").write("\n".join(lines) + "\n")
PY
}

bench_row() {  # which row
  local c n args=() label="$1 $NAME $2"
  if [ "$2" = long ]; then
    # warm with short prompts (not timed), so that the long prompts share no cached prefix
    $BPY $BENCH --base-url $BASE/v1 -n 2 -c 1 --max-tokens 16 --warmup 0 --ignore-eos "${MODEFLAG[@]}" > /dev/null 2>&1
    c=1; n=$LONG_N
    args=(--prompts-file $TMP/long_prompts.txt --max-tokens 16 --warmup 0)
  else
    c=${2%%:*}; n=${2##*:}
    args=(--max-tokens $OUT_TOKENS --warmup $WARMUP)
  fi
  local rss; rss=$(rss_start $SERVER_PID $TMP/row.json)
  $BPY $BENCH --base-url $BASE/v1 -c $c -n $n --ignore-eos "${MODEFLAG[@]}" "${args[@]}" \
    --label "$label" --out $TMP/row.jsonl > /dev/null 2> $TMP/bench.err
  local rc=$?
  rss_stop $rss
  tail -1 $TMP/bench.err
  [ -s $TMP/row.jsonl ] || { echo "  no result (rc $rc)"; cat $TMP/bench.err | tail -5; return 0; }
  SERVER=$1 ROW=$2 RUN_ID=$RUN_ID GGUF=$GGUF SERVER_ARGS=$SERVER_ARGS MODE=$MODE \
  python3 - "$RESULTS" $TMP/row.jsonl $TMP/row.json $TMP/life_$1.json <<'PY'
import json, os, sys
res, row, rss, life = sys.argv[1:5]
e = os.environ
r = json.loads(open(row).read().splitlines()[-1])
pk = json.load(open(rss)); lf = json.load(open(life))
r.update(run_id=e["RUN_ID"], server=e["SERVER"], row=e["ROW"], gguf=e["GGUF"],
         gguf_bytes=os.path.getsize(e["GGUF"]) if os.path.isfile(e["GGUF"]) else sum(os.path.getsize(os.path.join(e["GGUF"], f)) for f in os.listdir(e["GGUF"]) if f.endswith(".safetensors")), server_args=e["SERVER_ARGS"].strip(), mode=e["MODE"],
         cpu=next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
         peak_rss_bytes=pk["peak_rss_bytes"], peak_rss_gb=round(pk["peak_rss_bytes"] / 2**30, 3),
         procs_at_peak=pk["procs_at_peak"], rss_samples=pk["samples"],
         server_peak_rss_gb_so_far=round(lf["peak_rss_bytes"] / 2**30, 3))
open(res, "a").write(json.dumps(r) + "\n")
print(f"  peak RSS {r['peak_rss_gb']} GB over {pk['procs_at_peak']} processes ({pk['samples']} samples)")
PY
  rm -f $TMP/row.jsonl
}

case " $ROWS " in *" long "*) make_long_prompts || exit 1;; esac
SHORT_ROWS=$(echo " $ROWS " | sed 's/ long / /g')
for s in $SERVERS; do
  if [ -n "${SHORT_ROWS// /}" ]; then
    start_server $s || exit 1
    for row in $SHORT_ROWS; do bench_row $s $row; done
    case " $ROWS " in *" long "*) [ $s = switchyard ] && bench_row $s long;; esac
    stop_server; rss_stop $LIFE_RSS; LIFE_RSS=
  fi
  case " $ROWS " in *" long "*)
    if [ $s = llama ] || [ -z "${SHORT_ROWS// /}" ]; then
      start_server $s kvu || exit 1
      bench_row $s long
      stop_server; rss_stop $LIFE_RSS; LIFE_RSS=
    fi;;
  esac
done

python3 - "$RESULTS" "$RUN_ID" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get("run_id") == sys.argv[2]]
by = {(r["server"], r["row"]): r for r in rows}
order = list(dict.fromkeys(r["row"] for r in rows))
def f(x, d=1):
    return "-" if x is None else f"{x:.{d}f}"
def ratio(a, b):
    return "-" if a is None or b in (None, 0) else f"{a / b:.2f}"
print(f"\n{rows[0]['gguf'] if rows else ''}  (run {sys.argv[2]})")
print("| row | tok/s llama | tok/s Switchyard | ratio | TTFT p50 ms llama | Switchyard | ratio "
      "| peak RSS GB llama | Switchyard | ratio |")
print("|---|---|---|---|---|---|---|---|---|---|")
for row in order:
    a, b = by.get(("llama", row), {}), by.get(("switchyard", row), {})
    name = "long (c=1, ~1.5k-token prompts, 16 out)" if row == "long" else "c=%s (n=%s)" % tuple(row.split(":"))
    print(f"| {name} | {f(a.get('output_tok_per_s'))} | {f(b.get('output_tok_per_s'))} "
          f"| {ratio(b.get('output_tok_per_s'), a.get('output_tok_per_s'))} "
          f"| {f(a.get('ttft_ms_p50'), 0)} | {f(b.get('ttft_ms_p50'), 0)} "
          f"| {ratio(b.get('ttft_ms_p50'), a.get('ttft_ms_p50'))} "
          f"| {f(a.get('peak_rss_gb'), 2)} | {f(b.get('peak_rss_gb'), 2)} "
          f"| {ratio(b.get('peak_rss_gb'), a.get('peak_rss_gb'))} |")
for srv in ("llama", "switchyard"):
    life = [(r["row"], r["server_peak_rss_gb_so_far"], r["server_args"]) for r in rows if r["server"] == srv]
    if life:
        print(f"{srv}: peak RSS over each start, loading included: "
              + "; ".join(f"{g:.2f} GB up to row {row} ({a})" for row, g, a in life))
for r in rows:
    if r.get("errors") or r.get("mean_output_tokens_per_req") not in (None, r.get("max_tokens")):
        print(f"note: {r['server']} {r['row']}: {r['errors']} errors {r.get('first_error', '')[:120]}; "
              f"{r.get('mean_output_tokens_per_req')} tokens/request, finish {r.get('finish_reasons')}")
PY
