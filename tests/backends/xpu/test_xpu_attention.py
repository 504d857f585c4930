"""IPEX's paged-attention ops, through the XPU backend's kernel on the CPU device, against
core/ops's reference on ragged batches (decodes first, prompt chunks with and without cached
prefixes): every declared block size, GQA, float16, sliding windows and soft caps; and what
the kernel refuses when it is made."""
from __future__ import annotations

import random

import pytest
import torch

from switchyard.backends.xpu.ipex import load as load_ipex  # noqa: E402

try:  # IPEX, fitting this torch: only in the xpu environment (.ci/backend_env.sh xpu)
    load_ipex()
except ImportError as error:
    pytest.skip(str(error), allow_module_level=True)

from switchyard.backends.xpu import XpuBackend  # noqa: E402
from switchyard.backends.xpu.attention import UnsupportedAttention  # noqa: E402
from switchyard.backends.xpu.backend import BLOCK_SIZES  # noqa: E402
from switchyard.core.backend import AttentionSpec  # noqa: E402
from switchyard.core.testing.batches import ragged_lens, random_step  # noqa: E402

CPU = torch.device("cpu")
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _spec(block_size=16, group=2, dtype=torch.float32, head_dim=32, **extra) -> AttentionSpec:
    return AttentionSpec(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                         scale=head_dim ** -0.5, dtype=dtype, **extra)


def _check(backend: XpuBackend, spec: AttentionSpec, seed: int, lens=None, num_decodes=None) -> None:
    if lens is None:
        lens, num_decodes = ragged_lens(random.Random(seed), spec.block_size)
    step = random_step(spec, lens, num_decodes, seed, CPU)
    cache = backend.allocate_kv_cache(1, step.cache.shape[1], spec)[0]
    cache.copy_(step.cache)
    expected_cache, expected = step.reference()
    kernel = backend.attention(spec)
    kernel.write_kv(step.key, step.value, cache, step.meta)
    assert torch.equal(cache, expected_cache)
    out = kernel.forward(step.query, cache, step.meta)
    torch.testing.assert_close(out, expected, **TOL[spec.dtype])


@pytest.fixture(scope="module")
def backend():
    return XpuBackend(device="cpu")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_declared_block_size(backend, block_size):
    _check(backend, _spec(block_size=block_size, group=4), seed=block_size)


def test_float16_and_a_large_head_dim(backend):
    _check(backend, _spec(dtype=torch.float16, head_dim=128), seed=3)


def test_decode_only_and_prefill_only_steps(backend):
    _check(backend, _spec(), seed=1, lens=[(1, 1), (1, 40), (1, 17)], num_decodes=3)
    _check(backend, _spec(), seed=2, lens=[(9, 30), (16, 16), (1, 5)], num_decodes=0)  # a 1-token chunk


@pytest.mark.parametrize("window", [2, 5, 16])
def test_sliding_window_keeps_the_most_recent_keys(backend, window):
    _check(backend, _spec(sliding_window=window), seed=10 + window)


def test_soft_cap_bounds_the_logits(backend):
    _check(backend, AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, scale=1.0,
                                  soft_cap=2.0), seed=7)
    _check(backend, AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, scale=0.5,
                                  soft_cap=3.0), seed=8)


def test_what_the_ops_cannot_compute_is_refused_when_the_kernel_is_made(backend):
    with pytest.raises(UnsupportedAttention, match="do not split evenly"):
        backend.attention(AttentionSpec(num_heads=5, num_kv_heads=2, head_dim=32, block_size=16, scale=1.0))
    with pytest.raises(UnsupportedAttention, match="dtype"):
        backend.attention(_spec(dtype=torch.float64))
    with pytest.raises(UnsupportedAttention, match="sliding window with a soft cap"):
        backend.attention(_spec(sliding_window=8, soft_cap=30.0))
    with pytest.raises(UnsupportedAttention, match="sliding window of 1"):
        backend.attention(_spec(sliding_window=1))
    with pytest.raises(ValueError, match="block size 12"):
        backend.attention(_spec(block_size=12))


def test_a_cache_in_cores_layout_is_refused_not_misread(backend):
    spec = _spec()
    step = random_step(spec, [(1, 5)], 1, 0, CPU)
    with pytest.raises(ValueError, match="not in IPEX's layout"):
        backend.attention(spec).write_kv(step.key, step.value, step.cache.clone(), step.meta)
