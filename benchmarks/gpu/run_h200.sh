#!/usr/bin/env bash
# The GPU benchmark in one run on a machine that reaches no package index (see bench.py).
#
#   bash benchmarks/gpu/run_h200.sh [bench.py flags]        # log in $OUT (default /tmp/bench-out)
#
# Missing Python packages come as wheels in .whl/ (stevedore: `pip download --no-deps
# stevedore==5.10.0 -d .whl`); switchyard is imported through a path shim that mirrors
# pyproject's package-dir mapping, so nothing is built or installed into the system.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
shim=/tmp/switchyard-shim
rm -rf "$shim" && mkdir -p "$shim/switchyard"
for folder in core gateway backends; do ln -s "$PWD/$folder" "$shim/switchyard/$folder"; done
export PYTHONPATH=$shim:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
cd benchmarks/gpu
timeout -k 10 "${BENCH_TIMEOUT:-630}" python3 bench.py --out "$OUT" "$@"
status=$?
echo "bench.py exit status $status" | tee -a "$OUT/bench.log"
exit $status
