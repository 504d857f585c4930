"""CPU paged attention: decodes in place through the C++ kernel, else over gathered blocks.

When the backend's `PagedDecode` holds the compiled kernel (extension.py,
csrc/paged_decode.cpp), the batch's decodes are attended in one call that reads the
paged cache in place; prompt chunks, and decodes when the kernel is unavailable or
switched off, take the gather path below.

Per step (once, shared by every layer through a `StepPlanCache`) we turn the
metadata into a `_StepPlan`: one flat list of block ids to gather from each
layer's cache, and for every part of the batch an additive mask in the query
dtype. Per layer the kernel then, part by part, gathers the part's K and V blocks
(one `index_select` each, into a reused scratch buffer) and attends: decodes in
groups of DECODE_ROWS_PER_GROUP requests (so the gathered blocks are still in cache
when they are read), each prompt chunk on its own. No `.item()`: every size comes
from the metadata's CPU tuples.

Decodes fold grouped-query heads into the query-length axis (q [B, Hkv, group, D]
against k [B, Hkv, L, D]), which needs no K/V expansion; in bf16 a group of several
short decodes takes a batched-matmul path instead of SDPA (see `_attend_decodes`).
Prompt chunks use SDPA with `enable_gqa`. With a soft cap SDPA cannot be used; an
explicit float32 matmul-softmax path takes over.

A quantized cache (--kv-cache-dtype: one-byte codes and a float32 scale per token and head,
core/kv/quantized.py) is written with quantize_rows' bytes; the C++ kernel reads its codes in
place, and the gather path gathers its rows and turns them into values (dequantize_rows) before
attending.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from switchyard.core.backend import AttentionKernel, AttentionMetadata, AttentionSpec
from switchyard.core.kv.quantized import dequantize_rows, is_quantized, write_rows

from . import compiled_attention
from .extension import PagedDecode


@dataclass(frozen=True)
class _Part:
    """One SDPA call: queries [q_start, q_end) against gathered blocks [blk_start, blk_end)."""

    q_start: int
    q_end: int
    blk_start: int
    blk_end: int
    num_rows: int  # decodes: number of requests; chunk: 1
    # additive, query dtype; None means plain causal (top-left aligned). Decodes: [B, Hkv, 1, L * Hkv]
    mask: torch.Tensor | None
    is_decode: bool = False


@dataclass(frozen=True)
class _StepPlan:
    block_ids: torch.Tensor  # [N] int64: every block any part needs, in part order
    parts: tuple[_Part, ...]


# Decodes are gathered and attended this many requests at a time: the gathered K/V of a
# group stays in the core's cache between the gather and the matmuls (SmolLM2, bf16,
# 160-token contexts: 64 decodes in one group cost 7x what 32 do).
DECODE_ROWS_PER_GROUP = 16
# When decodes take the matmul path of CpuAttentionKernel._attend_decodes instead of SDPA.
MIN_ROWS_FOR_MATMUL_DECODES = 4
MAX_LENGTH_FOR_MATMUL_DECODES = 512


class StepPlanCache:
    """Remembers the plan of the current step's metadata (one frozen object per step,
    shared by all layers), keyed by what the plan depends on; and owns the scratch
    buffer the layers gather K/V into, one after the other. Reusing that buffer
    matters: a fresh multi-MB allocation per layer costs more in page faults than
    the gather itself."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._plans: dict[tuple, _StepPlan] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                purpose: str = "gather") -> torch.Tensor:
        """A buffer of this shape, valid until the next call for the same purpose (grows,
        never shrinks)."""
        numel, key = math.prod(shape), (dtype, device, purpose)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            with torch.inference_mode(False):  # a normal tensor: writable with and without inference mode
                buffer = torch.empty(numel + numel // 4, dtype=dtype, device=device)  # slack for growing contexts
            self._scratch[key] = buffer
        return buffer[:numel].view(shape)

    def get(self, meta: AttentionMetadata, block_size: int, window: int | None, dtype: torch.dtype,
            num_kv_heads: int, decodes: bool = True) -> _StepPlan:
        """The step's plan; without the decodes' parts when `decodes` is False (attended in place)."""
        if meta is not self._meta:  # holding the reference keeps id(meta) from being reused
            self._meta, self._plans = meta, {}
        key = (block_size, window, dtype, num_kv_heads, decodes)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _build_plan(meta, block_size, window, dtype, num_kv_heads, decodes)
        return plan


def _first_key(seq_len: int, q_len: int, window: int | None) -> int:
    """Earliest key position any of the request's queries may attend to."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _decode_part(meta: AttentionMetadata, block_size: int, window: int | None, dtype: torch.dtype,
                 num_kv_heads: int):
    """Each row sees keys [0, seq_len), in a window those past anchor - window (anchor: the row's
    AttentionMetadata.window_anchors entry, else seq_len - 1)."""
    num = meta.num_decodes
    seq_lens = meta.seq_lens_cpu[:num]
    anchors = [s - 1 for s in seq_lens] if meta.window_anchors_cpu is None else meta.window_anchors_cpu[:num]
    first_blocks = [_first_key(a + 1, 1, window) // block_size for a in anchors]
    num_cols = max((s - 1) // block_size - f + 1 for s, f in zip(seq_lens, first_blocks))
    cols = torch.tensor(first_blocks).unsqueeze(1) + torch.arange(num_cols)  # [B, C]
    table = meta.block_table[:num].to(device="cpu", dtype=torch.long)
    block_ids = table.gather(1, cols.clamp(max=table.shape[1] - 1)).reshape(-1)
    key_pos = (cols.unsqueeze(2) * block_size + torch.arange(block_size)).reshape(num, -1)  # [B, C*bs]
    allowed = key_pos < torch.tensor(seq_lens).unsqueeze(1)
    if window is not None:
        allowed &= key_pos > torch.tensor(anchors).unsqueeze(1) - window
    # [B, Hkv, 1, C*bs * Hkv]: query head group h may only see key head h (see _attend_decodes)
    same_head = torch.eye(num_kv_heads, dtype=torch.bool)
    allowed = allowed.view(num, 1, -1, 1) & same_head.view(1, num_kv_heads, 1, num_kv_heads)
    mask = _additive(allowed, dtype).view(num, num_kv_heads, 1, -1)
    return block_ids, mask


def _chunk_part(meta: AttentionMetadata, index: int, block_size: int, window: int | None, dtype: torch.dtype):
    q_start, q_end = meta.query_start_loc_cpu[index], meta.query_start_loc_cpu[index + 1]
    q_len, seq_len = q_end - q_start, meta.seq_lens_cpu[index]
    first_block = _first_key(seq_len, q_len, window) // block_size
    last_block = (seq_len - 1) // block_size
    block_ids = meta.block_table[index, first_block:last_block + 1].to(device="cpu", dtype=torch.long)
    if window is None and q_len == seq_len:
        return block_ids, None  # no cached prefix: SDPA's own (top-left) causal mask is exact
    key_pos = torch.arange(first_block * block_size, (last_block + 1) * block_size).unsqueeze(0)
    query_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return block_ids, _additive(allowed, dtype)


def _build_plan(meta: AttentionMetadata, block_size: int, window: int | None, dtype: torch.dtype,
                num_kv_heads: int, decodes: bool) -> _StepPlan:
    ids, parts, offset = [], [], 0
    if meta.num_decodes and decodes:
        block_ids, mask = _decode_part(meta, block_size, window, dtype, num_kv_heads)
        ids.append(block_ids)
        blocks_per_row = block_ids.numel() // meta.num_decodes
        for first in range(0, meta.num_decodes, DECODE_ROWS_PER_GROUP):
            last = min(first + DECODE_ROWS_PER_GROUP, meta.num_decodes)
            parts.append(_Part(first, last, first * blocks_per_row, last * blocks_per_row, last - first,
                               mask[first:last], is_decode=True))
        offset = block_ids.numel()
    for index in range(meta.num_decodes, meta.num_requests):
        block_ids, mask = _chunk_part(meta, index, block_size, window, dtype)
        start, end = meta.query_start_loc_cpu[index], meta.query_start_loc_cpu[index + 1]
        ids.append(block_ids)
        parts.append(_Part(start, end, offset, offset + block_ids.numel(), 1, mask))
        offset += block_ids.numel()
    block_ids = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
    return _StepPlan(block_ids.to(meta.block_table.device), tuple(parts))


def _explicit_attention(q, k, v, mask, scale: float, soft_cap: float) -> torch.Tensor:
    """Matmul-softmax in float32 with a soft cap; q [N, Hq, M, D], k/v [N, Hk, L, D], Hq % Hk == 0."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if mask is None:  # top-left causal
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        scores = scores.masked_fill(causal, float("-inf"))
    else:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


@cache
def sdpa_supports_gqa() -> bool:
    """Whether this torch's SDPA takes `enable_gqa` (torch >= 2.5)."""
    q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


class CpuAttentionKernel(AttentionKernel):
    """Decodes in place (when `decode` holds the compiled kernel), the rest SDPA over
    gathered blocks; matches `paged_attention_reference`. `decode` None: gather only."""

    def __init__(self, spec: AttentionSpec, plans: StepPlanCache | None = None, decode: PagedDecode | None = None):
        super().__init__(spec)
        self._decode = decode if decode is not None else PagedDecode(enabled=False)
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        self._group = spec.num_heads // spec.num_kv_heads
        self._plans = plans if plans is not None else StepPlanCache()
        self._native_gqa = self._group > 1 and sdpa_supports_gqa()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        if torch.compiler.is_compiling():  # traced by the compiled decode runner: one opaque op
            torch.ops.switchyard_cpu.write_kv(key, value, kv_cache, meta.slot_mapping)
            return
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.long else meta.slot_mapping.long()
        if is_quantized(kv_cache):
            write_rows(key, value, kv_cache, slots)
            return
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced_decodes(query, kv_cache, meta)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.num_requests == 0:
            return out
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        head_dim = self.spec.head_dim  # a quantized cache's rows are longer (its scales)
        in_place = self._decode.serves(meta.num_decodes)
        if in_place:
            self._decodes_in_place(self._decode.op, query, kv_cache, meta, out)
        plan = self._plans.get(meta, block_size, self.spec.sliding_window, query.dtype, num_kv_heads,
                               decodes=not in_place)
        for part in plan.parts:  # gather each part's blocks right before attending over them
            rows = part.num_rows
            kv = self._gather(kv_cache, plan.block_ids[part.blk_start:part.blk_end], query.dtype)
            kv = kv.view(2, rows, -1, num_kv_heads, head_dim)  # [2, rows, L, Hkv, D]
            if part.is_decode:
                q = query[part.q_start:part.q_end].reshape(rows, num_kv_heads, self._group, head_dim)
                o = self._attend_decodes(q, kv, part.mask)
                out[part.q_start:part.q_end].view(rows, num_kv_heads, self._group, head_dim).copy_(o)
            else:
                q = query[part.q_start:part.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
                o = self._attend(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), part.mask, gqa=True)
                out[part.q_start:part.q_end].copy_(o[0].transpose(0, 1))
        return out

    def _decodes_in_place(self, op, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          out: torch.Tensor) -> None:
        """The batch's decodes (its first rows) in one call of the C++ kernel, written into out."""
        num = meta.num_decodes
        compiled_attention.decode_in_place(op, query[:num], kv_cache, meta.block_table, meta.seq_lens,
                                           self.spec.scale, self.spec.sliding_window or 0,
                                           self.spec.soft_cap or 0.0, out[:num],
                                           meta.window_anchors)

    def _traced_decodes(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Under torch.compile (compiled.py: decode-only steps, every row one token): the in-place
        kernel as an opaque op over the metadata's tensors; its host tuples are never read."""
        if self._decode.op is None:
            raise RuntimeError("compiled decode steps need the in-place decode kernel, which is not loaded")
        if meta.window_anchors is not None:  # image rows never make a decode-only step (decode_only)
            raise RuntimeError("compiled decode steps take no window anchors")
        return torch.ops.switchyard_cpu.paged_decode(
            query, kv_cache, meta.block_table, meta.seq_lens, self.spec.scale, self.spec.sliding_window or 0,
            self.spec.soft_cap or 0.0, self._decode.op_name)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[2, N, bs, Hkv, D]: the blocks' keys and values, in a reused scratch buffer (a quantized
        cache's rows gathered as bytes, then turned into values of `dtype`)."""
        quantized = is_quantized(kv_cache)
        source = kv_cache.view(torch.uint8) if quantized else kv_cache  # index_select takes no float8
        gathered = self._plans.scratch((2, block_ids.numel(), *kv_cache.shape[2:]), source.dtype,
                                       kv_cache.device)
        torch.index_select(source[0], 0, block_ids, out=gathered[0])
        torch.index_select(source[1], 0, block_ids, out=gathered[1])
        if quantized:
            return dequantize_rows(gathered, kv_cache.dtype, dtype)
        return gathered if gathered.dtype == dtype else gathered.to(dtype)

    def _attend_decodes(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Hkv, group, D] against kv [2, B, L, Hkv, D] (gathered, token-major).

        SDPA's CPU flash kernel is slow on a few query rows against strided bf16 keys.
        For reduced precision, several rows and short contexts, each request's keys stay
        token-major, [L * Hkv, D], and every query head is scored against every key head
        in one contiguous batched matmul; the mask adds -inf where the heads differ (see
        _decode_part), so each softmax only spreads over its own head's keys, and the same
        matmul against [L * Hkv, D] values gathers them: Hkv times the (tiny) FLOPs, no
        copy. The arithmetic is Hugging Face's eager attention (scores in the input dtype,
        softmax in float32). Measured per layer, one core, SmolLM2: 16 decodes of 160
        tokens 229 vs 371 us, 32: 454 vs 728; but SDPA stays faster for one row, for
        1,100-token contexts, and in float32, so those keep it."""
        _, rows, length, num_kv_heads, head_dim = kv.shape
        if (self.spec.soft_cap is not None or q.dtype == torch.float32 or rows < MIN_ROWS_FOR_MATMUL_DECODES
                or length > MAX_LENGTH_FOR_MATMUL_DECODES):  # SDPA (or the soft-cap path) with the plain mask
            plain_mask = mask.view(rows, num_kv_heads, 1, length, num_kv_heads)[:, :1, :, :, 0]
            return self._attend(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), plain_mask, gqa=False)
        keys, values = kv[0].view(rows, length * num_kv_heads, head_dim), kv[1].view(rows, -1, head_dim)
        scores = torch.bmm(q.view(rows, -1, head_dim), keys.transpose(1, 2)).float()  # [B, H, L * Hkv]
        scores.view(*q.shape[:3], -1).mul_(self.spec.scale).add_(mask)  # mask [B, Hkv, 1, L * Hkv]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.bmm(probs, values).view(q.shape)

    def _attend(self, q, k, v, mask, gqa: bool) -> torch.Tensor:
        if self.spec.soft_cap is not None:
            return _explicit_attention(q, k, v, mask, self.spec.scale, self.spec.soft_cap)
        extra = {}
        if gqa and q.shape[1] != k.shape[1]:
            if self._native_gqa:
                extra["enable_gqa"] = True  # only passed when needed: torch < 2.5 lacks the keyword
            else:
                k, v = k.repeat_interleave(self._group, dim=1), v.repeat_interleave(self._group, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.spec.scale, **extra)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.spec.scale, **extra)
