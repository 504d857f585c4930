"""Paged attention through IPEX's ops (ipex.llm.modules.PagedAttention), the same calls on
XPU and CPU tensors:
- the KV write is `reshape_and_cache` (one call per layer and step);
- all decodes of a step are one `single_query_cached_kv_attention` call;
- all prompt chunks (with or without cached prefixes) are one `flash_attn_varlen_func` call,
  which reads keys and values straight from the paged cache through the block table
  (causal masking aligned bottom-right, so a chunk after a cached prefix is covered).
GQA goes through head_mapping (query head -> KV head).

KV layout: IPEX wants separate key and value caches of shape
[num_blocks, num_kv_heads, block_size, head_dim] (a cache of core's [blocks, slots, heads]
order segfaults inside reshape_and_cache, which checks no shapes). The backend allocates
[2, num_blocks, num_kv_heads, block_size, head_dim] and hands the engine its view with
core's index order, [2, num_blocks, block_size, num_kv_heads, head_dim]
(allocate_kv_cache); the kernel transposes it back, which is free.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from switchyard.core.backend import AttentionKernel, AttentionMetadata, AttentionSpec

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class UnsupportedAttention(ValueError):
    """An attention shape IPEX's paged ops cannot compute (raised when the kernel is made)."""


def ipex_kv_layout(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) [num_blocks, num_kv_heads, block_size, head_dim], contiguous,
    from the engine's view of a cache made by XpuBackend.allocate_kv_cache."""
    ipex_view = kv_cache.transpose(2, 3)
    if not ipex_view.is_contiguous():
        raise ValueError("the KV cache is not in IPEX's layout: allocate it with XpuBackend.allocate_kv_cache")
    return ipex_view[0], ipex_view[1]


def check_spec(spec: AttentionSpec) -> None:
    """Refuses, in one line, what the IPEX ops do not compute."""
    if spec.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedAttention(f"IPEX paged attention does not support dtype {spec.dtype}")
    if spec.num_heads % spec.num_kv_heads:
        raise UnsupportedAttention(f"{spec.num_heads} query heads do not split evenly over "
                                   f"{spec.num_kv_heads} KV heads")
    if spec.sliding_window is not None and spec.sliding_window < 2:
        # the varlen op reads a left window of 0 (a window of one key) as no window at all
        raise UnsupportedAttention(f"IPEX paged attention cannot apply a sliding window of "
                                   f"{spec.sliding_window} key(s); it needs at least 2")
    if spec.sliding_window is not None and spec.soft_cap is not None:
        # single_query_cached_kv_attention checks !(window_size > 0 && use_softcap) (IPEX 2.8)
        raise UnsupportedAttention("IPEX's decode op cannot combine a sliding window with a soft cap")
    if spec.soft_cap is not None and spec.soft_cap <= 0:
        raise UnsupportedAttention(f"soft cap {spec.soft_cap} must be positive")


@dataclass(frozen=True)
class StepPlan:
    """One step's IPEX arguments, shared by every layer (built by the first)."""

    meta: AttentionMetadata
    num_decode_tokens: int
    max_decode_len: int
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    max_prefill_query: int
    max_prefill_len: int

    @classmethod
    def build(cls, meta: AttentionMetadata) -> StepPlan:
        d = meta.num_decodes
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        device = meta.block_table.device
        prefill_lens = lens[d:]
        cu_q = [s - starts[d] for s in starts[d:]]
        cu_kv = [0]
        for length in prefill_lens:
            cu_kv.append(cu_kv[-1] + length)
        table = meta.block_table.to(torch.int32)
        return cls(meta, starts[d], max(lens[:d], default=0), table[:d].contiguous(),
                   meta.seq_lens[:d].to(torch.int32), table[d:].contiguous(),
                   torch.tensor(cu_q, dtype=torch.int32, device=device),
                   torch.tensor(cu_kv, dtype=torch.int32, device=device),
                   max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0), max(prefill_lens, default=0))


class StepPlanCache:
    """The plan of the step being run: layers after the first reuse it (one entry)."""

    def __init__(self):
        self._plan: StepPlan | None = None

    def get(self, meta: AttentionMetadata) -> StepPlan:
        if self._plan is None or self._plan.meta is not meta:
            self._plan = StepPlan.build(meta)
        return self._plan


class IpexPagedAttention(AttentionKernel):
    """One layer shape's attention through ipex.llm.modules.PagedAttention (module docstring)."""

    def __init__(self, spec: AttentionSpec, ops, plans: StepPlanCache | None = None):
        """ops: the PagedAttention class (ipex.py's paged_attention())."""
        check_spec(spec)
        super().__init__(spec)
        self.ops = ops
        self.plans = plans or StepPlanCache()
        group = spec.num_heads // spec.num_kv_heads
        self._head_mapping: dict[torch.device, torch.Tensor] = {}
        self._mapping_cpu = torch.arange(spec.num_kv_heads, dtype=torch.int32).repeat_interleave(group)
        # A window of W keys is window_size=W for IPEX's decode op, but window_size_left=W-1
        # (keys before the query, flash-attn's convention) for its varlen op; -1 = no window.
        window = spec.sliding_window
        self.decode_window = -1 if window is None else window
        self.window_left = -1 if window is None else window - 1
        self.soft_cap = -1.0 if spec.soft_cap is None else float(spec.soft_cap)

    def head_mapping(self, device: torch.device) -> torch.Tensor:
        if device not in self._head_mapping:
            self._head_mapping[device] = self._mapping_cpu.to(device)
        return self._head_mapping[device]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        key_cache, value_cache = ipex_kv_layout(kv_cache)
        self.ops.reshape_and_cache(key.to(kv_cache.dtype).contiguous(), value.to(kv_cache.dtype).contiguous(),
                                   key_cache, value_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = ipex_kv_layout(kv_cache)
        plan = self.plans.get(meta)
        query = query.contiguous()
        out = torch.empty_like(query)
        split = plan.num_decode_tokens
        spec = self.spec
        if meta.num_decodes:
            self.ops.single_query_cached_kv_attention(
                out[:split], query[:split], key_cache, value_cache, self.head_mapping(query.device), spec.scale,
                plan.decode_block_table, plan.decode_seq_lens, spec.block_size, plan.max_decode_len, None,
                self.decode_window, 1.0, 1.0, self.soft_cap)
        if meta.num_requests > meta.num_decodes:
            self.ops.flash_attn_varlen_func(
                out[split:], query[split:], key_cache, value_cache, plan.cu_seqlens_q, plan.cu_seqlens_kv,
                plan.max_prefill_query, plan.max_prefill_len, spec.scale, True, plan.prefill_block_table, None,
                self.window_left, -1, "auto", 1.0, 1.0, self.soft_cap)
        return out
