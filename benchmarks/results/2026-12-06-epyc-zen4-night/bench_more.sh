#!/bin/bash
# Switchyard alone on the 1.7B at c=1, level after level, to see whether the native level's c=1 is slower.
set -u
cd /work/main
P=$HOME/.cache/switchyard-peers
R=/work/main/benchmarks/results/2026-12-06-epyc-zen4-night
B17=$P/models/smollm2-1.7b-random-Q4_K_M.gguf
for isa in native avx2 avx512 native; do
  echo "$(date -u +%H:%M:%S) start c1 $isa (load: $(cut -d' ' -f1-3 /proc/loadavg))" >> $R/runs.log
  args=(); [ $isa != native ] && args=(--cpu-isa $isa)
  SERVERS=switchyard ROWS="1:8" WARMUP=8 RESULTS=$R/1.7b-c1-levels.jsonl bash benchmarks/gguf_side_by_side.sh $B17 "${args[@]}" > $R/c1-$isa.out 2>&1
  grep "c=1 (n=8)" $R/c1-$isa.out >> $R/runs.log
done
