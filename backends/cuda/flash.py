"""flash-attn's varlen kernel with a block table, when the `flash-attn` package is installed.

Upstream flash-attn 2 reads a paged KV cache of [num_blocks, block_size, kv_heads,
head_dim] (our layer cache's halves, as they are) through a block table, but only
for block sizes that are multiples of 256 and fp16/bf16 data (not a quantized cache,
--kv-cache-dtype); anything else falls
back to the Triton paged attention kernel, and the choice and its reason are
recorded (and printed by `switchyard backends`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchyard.core.backend import AttentionKernel, AttentionMetadata, AttentionSpec

FLASH_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def flash_attn_module():
    """The imported flash_attn module, or None when it is not installed or fails to import."""
    try:
        import flash_attn
    except Exception:  # ImportError, or a build that does not match this torch/CUDA
        return None
    return flash_attn if hasattr(flash_attn, "flash_attn_varlen_func") else None


@dataclass(frozen=True)
class AttentionChoice:
    impl: str  # "flash-attn" | "triton"
    reason: str


def describe_attention(flash_attn=None) -> str:
    """The capabilities line: which kernel the backend uses and why."""
    if flash_attn is None:
        return "triton paged attention (flash-attn not installed)"
    version = getattr(flash_attn, "__version__", "unknown version")
    return (f"flash-attn varlen (flash_attn {version} installed; block sizes that are multiples of "
            f"{FLASH_BLOCK_MULTIPLE}, fp16/bf16), else triton paged attention")


def choose_attention(spec: AttentionSpec, flash_attn=None) -> AttentionChoice:
    """flash-attn when it is installed and can serve this spec, else Triton, with the reason."""
    if flash_attn is None:
        return AttentionChoice("triton", "triton paged attention (flash-attn not installed)")
    version = getattr(flash_attn, "__version__", "unknown version")
    unfit = []
    if spec.block_size % FLASH_BLOCK_MULTIPLE:
        unfit.append(f"its paged KV needs block_size % {FLASH_BLOCK_MULTIPLE} == 0, got {spec.block_size}")
    if spec.dtype not in FLASH_DTYPES:
        unfit.append(f"it needs fp16/bf16, got {spec.dtype}")
    if spec.head_dim > FLASH_MAX_HEAD_DIM:
        unfit.append(f"head_dim {spec.head_dim} > {FLASH_MAX_HEAD_DIM}")
    if spec.quantized_cache:
        unfit.append(f"it reads no {spec.kv_cache_dtype} KV cache (--kv-cache-dtype)")
    if unfit:
        return AttentionChoice("triton", f"triton paged attention (flash_attn {version} installed, but "
                                         + "; ".join(unfit) + ")")
    return AttentionChoice("flash-attn", f"flash-attn varlen (flash_attn {version} installed)")


class FlashAttnKernel(AttentionKernel):
    """flash_attn_varlen_func over the paged cache; `write_kv` is the Triton scatter kernel
    (or any function with its contract: negative slots are skipped). flash-attn takes one window
    per call, counted back from each query's position: a step whose metadata carries window
    anchors (AttentionMetadata.window_anchors: image rows, never a decode graph's step) runs, in a
    sliding-window layer, on `anchored`, the Triton kernel of the same spec, which honours them."""

    graph_safe = True  # reads seq_lens/block_table from the device; max_seq_len is an upper bound

    def __init__(self, spec: AttentionSpec, varlen_func, write_kv_func, anchored: AttentionKernel | None = None):
        super().__init__(spec)
        self._varlen = varlen_func
        self._write_kv = write_kv_func
        self._anchored = anchored
        window = spec.sliding_window
        self._window = (window - 1, 0) if window is not None else (-1, -1)

    def write_kv(self, key, value, kv_cache, meta: AttentionMetadata) -> None:
        self._write_kv(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.window_anchors is not None and self.spec.sliding_window is not None:
            if self._anchored is None:
                raise RuntimeError("window anchors in a sliding-window layer, and no kernel that honours them")
            return self._anchored.forward(query, kv_cache, meta)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return self._varlen(query, kv_cache[0], kv_cache[1], cu_seqlens_q=meta.query_start_loc,
                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                            max_seqlen_k=meta.max_seq_len, softmax_scale=self.spec.scale, causal=True,
                            window_size=self._window, softcap=self.spec.soft_cap or 0.0,
                            block_table=meta.block_table)
