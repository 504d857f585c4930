"""Warm-up memory profiling and KV cache sizing, TGI style.

`profile_run` runs one largest step (max_num_batched_tokens prompt tokens spread over
up to max_num_seqs requests, with their logits and a softmax over them like a
sampling step) against a small temporary KV cache, and records the activation peak.
The KV cache then gets what `--cuda-memory-fraction` allows: the process may use
that fraction of the device's total memory, and what is still free of it after
the weights and the activation peak goes to the cache, less a little headroom for
CUDA graphs and allocator fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from switchyard.core.config import CacheConfig
from switchyard.core.execution.runner import build_step_input
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput

DEFAULT_CUDA_MEMORY_FRACTION = 1.0  # TGI's default for --cuda-memory-fraction
KV_HEADROOM = 0.95  # of the budget: graph pool, static buffers, fragmentation


@dataclass(frozen=True)
class MemoryProfile:
    free_bytes: int  # free device memory after the profiling step, its activations released
    total_bytes: int
    activation_peak_bytes: int  # what the largest step allocated at its peak, beyond the weights

    @property
    def available_bytes(self) -> int:
        """Free memory once a largest step's activations are set aside."""
        return max(0, self.free_bytes - self.activation_peak_bytes)


def kv_cache_budget_bytes(profile: MemoryProfile, memory_fraction: float | None) -> int:
    """Bytes the KV cache may take: TGI's rule, free - (1 - fraction) * total, after the profile."""
    fraction = DEFAULT_CUDA_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cuda memory fraction must be in (0, 1], got {fraction}")
    budget = profile.available_bytes - (1.0 - fraction) * profile.total_bytes
    return max(0, int(budget * KV_HEADROOM))


def num_kv_blocks_from_profile(profile: MemoryProfile, bytes_per_block: int, cache: CacheConfig) -> int:
    """Blocks of the KV cache (block 0 is reserved, so at least 2); raises when none fit."""
    budget = kv_cache_budget_bytes(profile, cache.memory_fraction)
    num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        gib = 2**30
        raise MemoryError(
            f"no device memory left for the KV cache: {profile.free_bytes / gib:.2f} GiB free of "
            f"{profile.total_bytes / gib:.2f} GiB after loading, a largest step needs "
            f"{profile.activation_peak_bytes / gib:.2f} GiB, and --cuda-memory-fraction "
            f"{cache.memory_fraction} keeps the rest; raise the fraction, lower --max-batch-prefill-tokens, "
            "or use a smaller model or more shards")
    return num_blocks


def profile_requests(num_tokens: int, num_requests: int, block_size: int) -> SchedulerOutput:
    """num_tokens prompt tokens split as evenly as possible over num_requests fresh requests,
    on consecutive blocks from 1 (block 0 is reserved)."""
    num_requests = max(1, min(num_requests, num_tokens))
    base, extra = divmod(num_tokens, num_requests)
    scheduled, next_block = [], 1
    for i in range(num_requests):
        length = base + (i < extra)
        num_blocks = -(-length // block_size)
        blocks = tuple(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        scheduled.append(ScheduledRequest(f"profile-{i}", (0,) * length, 0, blocks, True))
    return SchedulerOutput(tuple(scheduled))


@torch.inference_mode()
def profile_run(model, backend, device_ops, kv_spec, num_layers: int, max_num_batched_tokens: int,
                max_num_seqs: int) -> MemoryProfile:
    """Runs one largest step and measures (see the module docstring)."""
    block_size = kv_spec.block_size
    step_plan = profile_requests(max_num_batched_tokens, max_num_seqs, block_size)
    num_blocks = 1 + sum(len(s.block_ids) for s in step_plan.scheduled)
    kv_caches = backend.allocate_kv_cache(num_layers, num_blocks, kv_spec)
    device_ops.synchronize()
    device_ops.empty_cache()
    device_ops.reset_peak_memory_stats()
    base = device_ops.memory_allocated()  # weights and the temporary cache
    step = build_step_input(step_plan, block_size, backend.device)
    hidden = model(step.input_ids, step.positions, kv_caches, step.meta)
    logits = model.compute_logits(hidden[step.logits_indices])
    probs = torch.softmax(logits, dim=-1)  # a sampling step's vocabulary-sized temporaries
    del probs, logits, hidden, step, kv_caches
    device_ops.synchronize()
    peak = device_ops.max_memory_allocated() - base
    device_ops.empty_cache()
    free, total = device_ops.mem_get_info()
    return MemoryProfile(free_bytes=free, total_bytes=total, activation_peak_bytes=peak)
