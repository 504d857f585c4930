"""The XLA attention kernels on PJRT's CPU device against core/ops' reference, on ragged
batches as the engine lays them out, and padded to shape buckets as the runner pads them."""
from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")

import torch  # noqa: E402

from switchyard.backends.tpu.attention import PallasAttentionKernel, XlaAttentionKernel  # noqa: E402
from switchyard.backends.tpu.buckets import ShapeBuckets  # noqa: E402
from switchyard.backends.tpu.runner import pad_step  # noqa: E402
from switchyard.core.backend import AttentionSpec  # noqa: E402
from switchyard.core.execution.runner import StepInput  # noqa: E402
from switchyard.core.testing.batches import random_step, ragged_lens  # noqa: E402

DEVICE = torch_xla.device()


def spec(block_size=16, group=2, window=None, soft_cap=None, dtype=torch.float32):
    return AttentionSpec(num_heads=2 * group, num_kv_heads=2, head_dim=16, block_size=block_size,
                         scale=16 ** -0.5, dtype=dtype, sliding_window=window, soft_cap=soft_cap)


def padded(step, buckets: ShapeBuckets):
    """The step's metadata and tensors padded as the runner pads them (pad_step)."""
    tokens = step.query.shape[0]
    host = StepInput(input_ids=torch.zeros(tokens, dtype=torch.long), positions=torch.zeros(tokens, dtype=torch.long),
                     meta=replace(step.meta, query_start_loc=step.meta.query_start_loc.cpu(),
                                  seq_lens=step.meta.seq_lens.cpu(), block_table=step.meta.block_table.cpu(),
                                  slot_mapping=step.meta.slot_mapping.cpu()),
                     logits_indices=torch.zeros(0, dtype=torch.long), sampling_request_ids=())
    pad, _ = pad_step(host, buckets)
    meta = pad.meta
    meta = replace(meta, query_start_loc=meta.query_start_loc.to(DEVICE), seq_lens=meta.seq_lens.to(DEVICE),
                   block_table=meta.block_table.to(DEVICE), slot_mapping=meta.slot_mapping.to(DEVICE))
    extra = pad.input_ids.shape[0] - tokens

    def grow(t):
        return torch.cat([t, torch.zeros((extra, *t.shape[1:]), dtype=t.dtype, device=t.device)])
    return meta, grow(step.query), grow(step.key), grow(step.value)


@pytest.mark.parametrize("block_size, group, window, soft_cap, seed", [
    (8, 1, None, None, 1), (16, 3, None, None, 2), (16, 2, 12, None, 3), (8, 2, None, 30.0, 4)])
def test_xla_kernel_matches_the_reference_padded_to_buckets(block_size, group, window, soft_cap, seed):
    s = spec(block_size, group, window, soft_cap)
    lens, num_decodes = ragged_lens(random.Random(seed), block_size)
    step = random_step(s, lens, num_decodes, seed, DEVICE)
    expected_cache, expected = step.reference()
    buckets = ShapeBuckets.for_limits(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=6 * block_size,
                                      block_size=block_size)
    meta, query, key, value = padded(step, buckets)
    kernel = XlaAttentionKernel(s)
    cache = step.cache.clone()
    kernel.write_kv(key, value, cache, meta)
    out = kernel.forward(query, cache, meta)[:step.query.shape[0]].cpu()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    got_cache = cache.cpu()
    got_cache[:, 0] = expected_cache[:, 0]  # padding tokens write to reserved block 0 only
    assert torch.equal(got_cache, expected_cache)


def test_xla_kernel_in_bfloat16():
    s = spec(16, 2, dtype=torch.bfloat16)
    lens, num_decodes = ragged_lens(random.Random(7), 16)
    step = random_step(s, lens, num_decodes, 7, DEVICE)
    _, expected = step.reference()
    kernel = XlaAttentionKernel(s)
    cache = step.cache.clone()
    kernel.write_kv(step.key, step.value, cache, step.meta)
    torch.testing.assert_close(kernel.forward(step.query, cache, step.meta).cpu(), expected, atol=3e-2, rtol=3e-2)


def test_pallas_kernel_arguments_through_torch_xlas_reference_path():
    """The TPU kernel's call (interleaved K/V pages, int32 lengths, page table, cu_q_lens)
    checked through ragged_paged_attention's own pure-torch path (use_kernel=False): the
    Pallas kernel itself needs a TPU v4+. Small: that path compiles per sequence."""
    s = spec(8, 2)
    step = random_step(s, [(1, 9), (4, 12)], 1, 11, DEVICE, num_blocks=8)
    _, expected = step.reference()
    kernel = PallasAttentionKernel(s, use_kernel=False)
    cache = step.cache.clone()
    kernel.write_kv(step.key, step.value, cache, step.meta)
    torch.testing.assert_close(kernel.forward(step.query, cache, step.meta).cpu(), expected, atol=2e-5, rtol=1e-4)
