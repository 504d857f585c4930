"""The CPU attention call as two custom ops, opaque to torch.compile.

When the compiled decode runner (compiled.py) traces the model, each layer's
`CpuAttentionKernel.write_kv` and `forward` become one call each of the ops below
instead of Python that reads the step's host metadata (which a graph would freeze):

- `switchyard_cpu::write_kv(key, value, kv_cache!, slot_mapping)` scatters the new keys
  and values into the paged cache in place (it declares the mutation, so the graph
  orders it before the read); rows with a negative slot (the runner's padding) write
  nothing.
- `switchyard_cpu::paged_decode(query, kv_cache, block_table, seq_lens, scale, window,
  soft_cap, kernel)` attends one query token per row through the in-place C++ decode
  kernel (extension.py), which reads only these tensors; `kernel` names that op
  ("namespace::paged_decode"): every build has its own namespace.

A quantized cache (--kv-cache-dtype) is written as core/kv/quantized.py's rows and read by the
same kernel, which takes the query in its own dtype then.

Both have fake implementations, so dynamo and inductor see shapes, not data. The eager
path of the kernel shares `decode_in_place` with the op.
"""
from __future__ import annotations

from functools import cache
from typing import Callable

import torch

from switchyard.core.kv.quantized import is_quantized, write_rows


def decode_in_place(op: Callable[..., None], query: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
                    soft_cap: float, out: torch.Tensor, anchors: torch.Tensor | None = None) -> None:
    """One call of the C++ kernel for the rows of `query` (one decode each), written into out.
    The kernel computes in the cache's dtype (over a quantized cache, the query's); query and out
    are converted around it. `anchors` (AttentionMetadata.window_anchors): where each row's window
    counts back from; None: seq_len - 1."""
    dtype = query.dtype if is_quantized(kv_cache) else kv_cache.dtype
    if query.dtype != dtype or query.stride(-1) != 1:
        query = query.to(dtype).contiguous()
    same_dtype = out.dtype == dtype
    target = out if same_dtype else torch.empty(query.shape, dtype=dtype)
    if anchors is None:
        op(target, query, kv_cache, block_table.to(torch.int32), seq_lens.to(torch.int32), scale, window, soft_cap)
    else:
        op(target, query, kv_cache, block_table.to(torch.int32), seq_lens.to(torch.int32), scale, window, soft_cap,
           anchors.to(torch.int32))
    if not same_dtype:
        out.copy_(target)


@cache
def resolve_kernel(qualified_name: str) -> Callable[..., None]:
    """The loaded C++ op "namespace::name" (torch.ops.namespace.name)."""
    namespace, _, name = qualified_name.partition("::")
    return getattr(getattr(torch.ops, namespace), name)


@torch.library.custom_op("switchyard_cpu::write_kv", mutates_args=("kv_cache",))
def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] into kv_cache [2, blocks, block_size, Hkv, D] at slot_mapping [T]."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):  # padding rows come last and write nothing
        key, value, slots = key[keep], value[keep], slots[keep]
    if is_quantized(kv_cache):
        write_rows(key, value, kv_cache, slots)
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))


@write_kv.register_fake
def _(key, value, kv_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("switchyard_cpu::paged_decode", mutates_args=())
def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, window: int, soft_cap: float, kernel: str) -> torch.Tensor:
    """query [B, H, D] (one token per row) -> [B, H, D] in query's dtype."""
    out = torch.empty(query.shape, dtype=query.dtype)
    decode_in_place(resolve_kernel(kernel), query, kv_cache, block_table, seq_lens, scale, window, soft_cap, out)
    return out


@paged_decode.register_fake
def _(query, kv_cache, block_table, seq_lens, scale, window, soft_cap, kernel):
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)
