"""Triton paged attention behind the AttentionKernel interface (CUDA and ROCm).

Triton is imported when a kernel is built, not when this module is imported, so
the backend's plugin discovery works where triton is absent.
"""
from __future__ import annotations

import torch

from switchyard.core.backend import AttentionKernel, AttentionMetadata, AttentionSpec


class TritonAttentionKernel(AttentionKernel):
    """write_kv scatters by slot (negative slots are skipped); forward is one launch
    over the whole ragged batch. Decode-only steps (max_query_len == 1) use a grid
    that depends only on the number of requests, and flash-decoding splits chosen
    from static sizes, so they can be captured in a CUDA graph. Honours the metadata's window
    anchors (Capabilities.window_anchors)."""

    graph_safe = True  # decode-only batches read the metadata's device tensors and shapes alone

    def __init__(self, spec: AttentionSpec, num_sms: int | None = None):
        super().__init__(spec)
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        from . import kernels  # imports triton

        self._kernels = kernels
        self._num_sms = num_sms  # None: asked of the device on first use

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self._kernels.write_kv(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        spec = self.spec
        num_requests = meta.seq_lens.shape[0]
        num_kv_splits = self._kernels.choose_num_kv_splits(num_requests, spec.num_kv_heads, meta.max_query_len,
                                                           self._device_sms(query.device))
        return self._kernels.paged_attention(
            query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale=spec.scale,
            max_query_len=meta.max_query_len, sliding_window=spec.sliding_window, soft_cap=spec.soft_cap,
            num_kv_splits=num_kv_splits, window_anchors=meta.window_anchors)

    def _device_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":  # also ROCm's HIP build of torch
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = 1  # the interpreter on a CPU: no splits
        return self._num_sms
