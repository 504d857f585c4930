"""bitsandbytes' own ops, device-neutral, as every backend's bitsandbytes kernels call them
(backends/cpu/bnb_linear.py, backends/cuda/bnb_linear.py): the library import, and LLM.int8's
matmul as bitsandbytes' MatMul8bitLt runs inference (torch.ops.bitsandbytes dispatches each op to
the tensors' device: its C++ CPU kernels, its CUDA kernels)."""
from __future__ import annotations

import logging

import torch

THRESHOLD = 6.0  # LLM.int8's outlier threshold (bitsandbytes' and TGI's default)


class _QuietHubKernel(logging.Filter):
    """bitsandbytes' CPU backend tries, at import, to fetch an optional kernel from the Hugging Face
    Hub (the `kernels` package) and warns when it cannot; its own kernel serves instead. Dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


_QUIET = _QuietHubKernel()


def import_bnb():
    """bitsandbytes.functional, or None where bitsandbytes is not installed."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_QUIET)  # once: a filter is added once
    try:
        import bitsandbytes.functional as functional
    except ImportError:
        return None
    return functional


@torch.library.custom_op("switchyard_bnb::int8_matmul", mutates_args=())
def int8_matmul(x: torch.Tensor, CB: torch.Tensor, SCB: torch.Tensor) -> torch.Tensor:
    """LLM.int8 through bitsandbytes' ops, as its MatMul8bitLt runs inference: x [M, K] (any float
    dtype) rounded to int8 per row from its fp16 copy, the outlier columns multiplied in x's dtype;
    CB int8 [N, K], SCB float32 [N] -> [M, N] in x's dtype. One op to torch.compile: the outlier
    columns' count depends on the values (which also makes it a host sync: no CUDA graph holds it)."""
    CA, SCA, outliers = torch.ops.bitsandbytes.int8_vectorwise_quant.default(x.to(torch.float16), THRESHOLD)
    out, _ = torch.ops.bitsandbytes.int8_mixed_scaled_mm.default(x, CA, CB, SCA, SCB, outliers, None)
    return out


@int8_matmul.register_fake
def _(x, CB, SCB):
    return x.new_empty((x.shape[0], CB.shape[0]))
