"""Random but valid quantized weights of every GGUF block format (core/quant/weight.py), for a
backend's kernel tests: random bytes with finite fp16 scale fields of either sign."""
from __future__ import annotations

import numpy as np
import torch

from ..quant.weight import BLOCK_BYTES, BLOCK_WEIGHTS, QuantizedWeight

BLOCK_FORMATS = tuple(BLOCK_WEIGHTS)
# Byte offsets of each format's fp16 fields (d, and m or dmin).
FP16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
               "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(fmt: str, rows: int, blocks: int, seed: int = 0, scale: tuple[float, float] = (1e-3, 1e-1)) -> QuantizedWeight:
    """`rows` rows of `blocks` blocks (32 or 256 weights each); fp16 fields uniform in `scale` in size."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, blocks, BLOCK_BYTES[fmt]), dtype=np.uint8)
    for offset in FP16_FIELDS[fmt]:
        values = rng.uniform(*scale, (rows, blocks)) * rng.choice([-1.0, 1.0], (rows, blocks))
        data[..., offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return QuantizedWeight(fmt, (rows, blocks * BLOCK_WEIGHTS[fmt]), torch.from_numpy(data.reshape(rows, -1)))
