"""The Triton kernels of the CUDA/ROCm backend against the plain-torch references.

Without a GPU they run under Triton's interpreter (numpy, one program at a time),
so shapes stay small; with a CUDA device the same tests run compiled kernels. Quantized KV
caches (--kv-cache-dtype int8, fp8_e4m3fn, fp8_e5m2) are written as core/kv/quantized.py's rows
and read against the reference over the same codes.
"""
from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import zlib

import pytest
import torch

from triton_interpreter import DEVICE, ON_GPU, RUNS_HERE, rerun_in_fresh_process, skip_unless_runnable  # noqa: E402  (first: sets TRITON_INTERPRET)

from switchyard.core.backend import KV_CACHE_FORMATS, AttentionMetadata, AttentionSpec  # noqa: E402
from switchyard.core.kv.quantized import quantize_rows  # noqa: E402
from switchyard.core.layers import RMSNorm, SiluAndMul, apply_rotary  # noqa: E402
from switchyard.core.layers.rotary import RotaryEmbedding  # noqa: E402
from switchyard.core.ops.attention import ReferenceAttentionKernel, paged_attention_reference  # noqa: E402
from switchyard.core.ops.attention import write_kv_reference  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float16: dict(atol=4e-3, rtol=4e-3)}


@pytest.fixture(autouse=True)
def _needs_working_kernels(request):
    skip_unless_runnable(request)


import switchyard.backends.cuda.kernels as kernels  # noqa: E402
from switchyard.backends.cuda.attention import TritonAttentionKernel  # noqa: E402


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on DEVICE (never an alias, also on a CPU), so in-place kernels cannot touch the inputs."""
    return tensor.to(DEVICE, copy=True)


def make_meta(lens: list[tuple[int, int]], block_size: int, num_blocks: int, rng: random.Random,
              max_query_len: int | None = None) -> AttentionMetadata:
    """lens: (query_len, seq_len) per request, decodes first; (0, 0) is a padding
    request. Blocks are random, distinct, never 0; the table has a column of padding."""
    needed = [-(-seq_len // block_size) for _, seq_len in lens]
    ids = rng.sample(range(1, num_blocks), sum(needed))
    table = torch.zeros(len(lens), max(needed, default=0) + 1, dtype=torch.int32)
    slots, starts = [], [0]
    for row, ((q_len, seq_len), count) in enumerate(zip(lens, needed)):
        table[row, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
        slots += [int(table[row, pos // block_size]) * block_size + pos % block_size
                  for pos in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    real_max = max((q for q, _ in lens), default=0)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32, device=DEVICE),
        block_table=table.to(DEVICE), slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        num_decodes=sum(q == 1 for q, _ in lens), max_query_len=max_query_len or real_max,
        max_seq_len=max((s for _, s in lens), default=0), query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(s for _, s in lens))


def ragged_batch(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    decodes = [(1, rng.randint(1, 4 * block_size)) for _ in range(rng.randint(1, 3))]
    chunks = [(q, q + rng.choice([0, rng.randint(1, 2 * block_size)])) for q in
              (rng.randint(2, block_size + 9) for _ in range(rng.randint(1, 2)))]
    return decodes + chunks + [(5, 5)]  # and a whole prompt without cached prefix


def random_step(spec: AttentionSpec, lens, seed: int, num_blocks: int = 48, max_query_len: int | None = None):
    """(meta, cache with the step's K/V written by the reference, query) on DEVICE; the cache's rows
    quantized where the spec's cache is (--kv-cache-dtype)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    meta = make_meta(lens, spec.block_size, num_blocks, rng, max_query_len)
    num_tokens = meta.query_start_loc_cpu[-1]
    cache = torch.randn(2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, generator=gen)
    key, value = (torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, generator=gen) for _ in range(2))
    write_kv_reference(key, value, cache, meta.slot_mapping.cpu())
    query = torch.randn(num_tokens, spec.num_heads, spec.head_dim, generator=gen)
    if spec.quantized_cache:
        quantized = quantize_rows(cache, spec.cache_dtype).view(spec.cache_dtype)
        return meta, quantized.to(DEVICE), query.to(DEVICE, spec.dtype)
    return meta, cache.to(DEVICE, spec.dtype), query.to(DEVICE, spec.dtype)


def reference(spec: AttentionSpec, meta: AttentionMetadata, cache, query) -> torch.Tensor:
    return paged_attention_reference(query.cpu(), cache.cpu(), list(meta.query_start_loc_cpu),
                                     list(meta.seq_lens_cpu), meta.block_table.cpu(), spec.scale,
                                     spec.sliding_window, spec.soft_cap)


def triton_attention(spec: AttentionSpec, meta: AttentionMetadata, cache, query, **overrides) -> torch.Tensor:
    args = dict(scale=spec.scale, max_query_len=meta.max_query_len, sliding_window=spec.sliding_window,
                soft_cap=spec.soft_cap, **overrides)
    return kernels.paged_attention(query, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, **args)


def make_spec(group: int, block_size: int, head_dim: int = 64, num_kv_heads: int = 2, **extra) -> AttentionSpec:
    scale = extra.pop("scale", head_dim ** -0.5)
    return AttentionSpec(num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         block_size=block_size, scale=scale, **extra)


RAGGED_CASES = [  # dtype, block_size, group, head_dim, window, soft_cap
    (torch.float32, 16, 1, 64, None, None),
    (torch.float32, 8, 2, 64, None, None),
    (torch.float32, 32, 4, 128, None, None),
    (torch.float32, 16, 3, 64, 5, None),  # a group that is not a power of two
    (torch.float32, 8, 4, 64, 19, None),
    (torch.float32, 32, 2, 64, None, 2.0),
    (torch.float32, 16, 2, 128, 11, 3.0),
    (torch.float32, 8, 8, 64, None, None),
    (torch.bfloat16, 16, 2, 64, None, None),
    (torch.bfloat16, 32, 4, 128, 7, 3.0),
    (torch.float16, 8, 1, 64, 9, None),
    (torch.float32, 16, 4, 256, 7, None),  # Gemma 3's shape: head_dim 256, 4 query heads per key head
    (torch.float32, 16, 2, 256, 6, 3.0),  # Gemma 2-like: head_dim 256, a window and a soft cap
]


@pytest.mark.parametrize("dtype,block_size,group,head_dim,window,soft_cap", RAGGED_CASES)
def test_paged_attention_matches_reference_on_ragged_batches(dtype, block_size, group, head_dim, window, soft_cap):
    seed = zlib.crc32(repr((dtype, block_size, group, head_dim, window, soft_cap)).encode()) % 10_000
    spec = make_spec(group, block_size, head_dim, dtype=dtype, sliding_window=window, soft_cap=soft_cap)
    meta, cache, query = random_step(spec, ragged_batch(random.Random(seed), block_size), seed)
    out = triton_attention(spec, meta, cache, query)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu(), reference(spec, meta, cache, query), **TOLERANCE[dtype])


@pytest.mark.parametrize("lens", [
    [(1, 1), (1, 9), (1, 40), (1, 16)],  # only decodes
    [(12, 12), (5, 30)],  # only prompt chunks, one with a cached prefix
    [(1, 17), (33, 33)],  # a prompt spanning several query tiles next to a decode
    [(1, 20), (1, 150), (40, 157), (9, 9)],  # mixed, long cached prefixes: several 64-key tiles
])
@pytest.mark.parametrize("window", [None, 6])
def test_batch_shapes(lens, window):
    spec = make_spec(group=2, block_size=16, sliding_window=window)
    meta, cache, query = random_step(spec, lens, seed=7)
    torch.testing.assert_close(triton_attention(spec, meta, cache, query).cpu(), reference(spec, meta, cache, query),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_kv_splits", [2, 16])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (10, 2.0)])
def test_decode_with_kv_splits(num_kv_splits, window, soft_cap):
    """Flash-decoding: each request's keys split over programs, then merged; short
    requests leave some splits empty."""
    spec = make_spec(group=4, block_size=8, sliding_window=window, soft_cap=soft_cap)
    meta, cache, query = random_step(spec, [(1, 1), (1, 7), (1, 150), (1, 33)], seed=num_kv_splits)
    out = triton_attention(spec, meta, cache, query, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out.cpu(), reference(spec, meta, cache, query), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_padded_decode_step_as_captured_in_a_graph(num_kv_splits):
    """A CUDA-graph batch: padding requests with no query token, a padding token
    whose slot is -1, an `out` buffer; the real rows match and nothing else is touched."""
    spec = make_spec(group=2, block_size=16)
    real = [(1, 5), (1, 37), (1, 18)]
    meta, cache, query = random_step(spec, real, seed=3)
    padded = make_meta(real + [(0, 0), (0, 0)], 16, 48, random.Random(3))
    assert torch.equal(padded.block_table[:3], meta.block_table)
    padded_query = torch.cat([query, torch.randn(1, *query.shape[1:], device=DEVICE)])  # one padding token
    out = torch.full_like(padded_query, 7.0)
    result = triton_attention(spec, padded, cache, padded_query, out=out, num_kv_splits=num_kv_splits)
    assert result is out
    torch.testing.assert_close(out[:3].cpu(), reference(spec, meta, cache, query), **TOLERANCE[torch.float32])
    assert torch.all(out[3] == 7.0)


def test_static_max_query_len_bound_and_no_host_tuples():
    """The grid may be sized from a static bound larger than this step's longest
    query, and the kernel never reads the metadata's CPU tuples."""
    spec = make_spec(group=2, block_size=8, sliding_window=9)
    meta, cache, query = random_step(spec, [(1, 12), (3, 10), (6, 6)], seed=5, max_query_len=64)
    blind = dataclasses.replace(meta, query_start_loc_cpu=(), seq_lens_cpu=())
    kernel = TritonAttentionKernel(spec)
    torch.testing.assert_close(kernel.forward(query, cache, blind).cpu(), reference(spec, meta, cache, query),
                               **TOLERANCE[torch.float32])


def test_soft_cap_and_window_change_the_result():
    """Guards the tests above: the cases they cover really differ from plain causal attention."""
    base = make_spec(group=2, block_size=8, scale=1.0)
    meta, cache, query = random_step(base, [(1, 30), (9, 25)], seed=3)
    plain = triton_attention(base, meta, cache, query)
    for variant in (dict(soft_cap=2.0), dict(sliding_window=5)):
        spec = dataclasses.replace(base, **variant)
        out = triton_attention(spec, meta, cache, query)
        torch.testing.assert_close(out.cpu(), reference(spec, meta, cache, query), **TOLERANCE[torch.float32])
        assert not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
def test_write_kv_scatters_by_slot_and_skips_negative_slots(block_size, key_dtype):
    rng, gen = random.Random(block_size), torch.Generator().manual_seed(block_size)
    meta = make_meta([(1, 9), (6, 20)], block_size, 16, rng)
    slots = meta.slot_mapping.clone()
    slots[2] = -1  # a padded row
    qkv = torch.randn(slots.shape[0], 4 + 2 * 2, 64, generator=gen).to(key_dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views of a fused projection
    cache = torch.randn(2, 16, block_size, 2, 64, generator=gen).to(torch.bfloat16)
    expected = cache.clone()
    keep = slots.cpu() >= 0
    write_kv_reference(key[keep], value[keep], expected, slots.cpu()[keep])
    device_cache = on_device(cache)
    kernels.write_kv(on_device(key), on_device(value), device_cache, slots)
    if key_dtype == torch.bfloat16 or ON_GPU:
        assert torch.equal(device_cache.cpu(), expected)
    else:  # the interpreter truncates float32 -> bfloat16 where GPUs round to nearest even
        torch.testing.assert_close(device_cache.cpu(), expected, atol=0, rtol=2 ** -7)
    assert torch.equal(device_cache.cpu().view(2, -1, 2, 64)[:, meta.slot_mapping[2]],
                       cache.view(2, -1, 2, 64)[:, meta.slot_mapping[2]])  # the skipped row's slot is untouched


def test_kernel_class_matches_reference_kernel():
    spec = make_spec(group=3, block_size=16, dtype=torch.bfloat16, sliding_window=12)
    lens = [(1, 30), (1, 4), (10, 25), (4, 4)]
    meta, cache, query = random_step(spec, lens, seed=11)
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(query.shape[0], 2, 64, generator=gen).to(DEVICE, spec.dtype) for _ in range(2))
    expected_cache = cache.cpu().clone()
    ReferenceAttentionKernel(spec).write_kv(key.cpu(), value.cpu(), expected_cache, dataclasses.replace(
        meta, slot_mapping=meta.slot_mapping.cpu()))
    kernel = TritonAttentionKernel(spec)
    kernel.write_kv(key, value, cache, meta)
    assert torch.equal(cache.cpu(), expected_cache)
    torch.testing.assert_close(kernel.forward(query, cache, meta).cpu(), reference(spec, meta, cache, query),
                               **TOLERANCE[spec.dtype])


def anchored(meta: AttentionMetadata, anchors: list[int]) -> AttentionMetadata:
    return dataclasses.replace(meta, window_anchors=torch.tensor(anchors, dtype=torch.int32, device=DEVICE),
                               window_anchors_cpu=tuple(anchors))


def anchored_reference(spec: AttentionSpec, meta: AttentionMetadata, cache, query) -> torch.Tensor:
    return paged_attention_reference(query.cpu(), cache.cpu(), list(meta.query_start_loc_cpu),
                                     list(meta.seq_lens_cpu), meta.block_table.cpu(), spec.scale,
                                     spec.sliding_window, spec.soft_cap, list(meta.window_anchors_cpu))


# An image chunk's rows (core/multimodal/image_rows.py: positions 6-11, an image at 7-11, each of its
# rows seeing up to 11 with its own position as anchor), a decode of 120 anchored at 60.
IMAGE_ROWS = [(1, 7)] + [(1, 12)] * 5, list(range(6, 12))
OTHER_ROWS = [(1, 120)], [60]


@pytest.mark.parametrize("chunk,num_kv_splits", [(False, 1), (False, 4), (True, 1)],
                         ids=["decode rows", "decode rows, kv splits", "and a prompt chunk"])
def test_window_anchors_move_each_rows_window(chunk, num_kv_splits):
    """Per-row window anchors (AttentionMetadata.window_anchors) in a sliding layer: the kernel (the
    class, given the metadata; the launcher with flash-decoding splits) matches the reference, and
    the rows whose anchor moves their window's first key differ from the anchor-less result."""
    spec = make_spec(group=2, block_size=8, head_dim=32, dtype=torch.float32, sliding_window=4)
    lens = IMAGE_ROWS[0] + OTHER_ROWS[0] + ([(5, 14)] if chunk else [])
    anchors = IMAGE_ROWS[1] + OTHER_ROWS[1] + ([13] if chunk else [])
    plain, cache, query = random_step(spec, lens, seed=5, num_blocks=40)
    meta = anchored(plain, anchors)
    expected = anchored_reference(spec, meta, cache, query)
    if num_kv_splits == 1:
        out = TritonAttentionKernel(spec).forward(query, cache, meta)
    else:
        out = triton_attention(spec, meta, cache, query, num_kv_splits=num_kv_splits,
                               window_anchors=meta.window_anchors)
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[spec.dtype])
    without = reference(spec, plain, cache, query)
    moved = [1, 2, 3, 4, 6]  # rows at 7-10 (11's window starts at 8 either way), and the long decode
    assert (without[moved] - expected[moved]).abs().amax(dim=(1, 2)).min() > 0.05
    still = [i for i in range(len(query)) if i not in moved]
    torch.testing.assert_close(without[still], expected[still], **TOLERANCE[spec.dtype])


QUANTIZED_CASES = [  # kv_cache_dtype, dtype, block_size, group, head_dim, window, soft_cap
    ("int8", torch.float32, 16, 2, 64, None, None),
    ("int8", torch.bfloat16, 8, 3, 128, 7, 3.0),
    ("fp8_e4m3fn", torch.float32, 32, 4, 64, None, 2.0),
    ("fp8_e4m3fn", torch.float16, 16, 1, 64, 9, None),
    ("fp8_e5m2", torch.float32, 8, 2, 128, 5, None),
    ("fp8_e5m2", torch.bfloat16, 16, 4, 64, None, None),
]


@pytest.mark.parametrize("kv_cache_dtype,dtype,block_size,group,head_dim,window,soft_cap", QUANTIZED_CASES)
def test_paged_attention_reads_quantized_caches(kv_cache_dtype, dtype, block_size, group, head_dim, window, soft_cap):
    """Ragged batches over a quantized cache: codes turned into values in the kernel, scales
    applied to scores and weights, the reference's output over the same codes."""
    seed = zlib.crc32(repr((kv_cache_dtype, dtype, block_size, group)).encode()) % 10_000
    spec = make_spec(group, block_size, head_dim, dtype=dtype, sliding_window=window, soft_cap=soft_cap,
                     kv_cache_dtype=kv_cache_dtype)
    meta, cache, query = random_step(spec, ragged_batch(random.Random(seed), block_size), seed)
    assert cache.dtype == KV_CACHE_FORMATS[kv_cache_dtype] and cache.shape[-1] == head_dim + 4
    out = triton_attention(spec, meta, cache, query)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu(), reference(spec, meta, cache, query), **TOLERANCE[dtype])


@pytest.mark.parametrize("kv_cache_dtype", sorted(KV_CACHE_FORMATS))
def test_decode_over_a_quantized_cache_with_kv_splits(kv_cache_dtype):
    spec = make_spec(group=4, block_size=8, sliding_window=40, kv_cache_dtype=kv_cache_dtype)
    meta, cache, query = random_step(spec, [(1, 1), (1, 7), (1, 150), (1, 33)], seed=4)
    out = triton_attention(spec, meta, cache, query, num_kv_splits=4)
    torch.testing.assert_close(out.cpu(), reference(spec, meta, cache, query), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("kv_cache_dtype", sorted(KV_CACHE_FORMATS))
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
def test_write_kv_stores_quantized_rows_and_skips_negative_slots(kv_cache_dtype, key_dtype):
    """The reference's bytes (quantize_rows: codes and scale per token and head) at each slot; a
    padded row's slot untouched."""
    code = KV_CACHE_FORMATS[kv_cache_dtype]
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    meta = make_meta([(1, 9), (6, 20)], 8, 16, rng)
    slots = meta.slot_mapping.clone()
    slots[2] = -1
    qkv = torch.randn(slots.shape[0], 8, 64, generator=gen).to(key_dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views of a fused projection
    cache = quantize_rows(torch.randn(2, 16, 8, 2, 64, generator=gen), code).view(code)
    expected = cache.clone()
    keep = slots.cpu() >= 0
    write_kv_reference(key[keep], value[keep], expected, slots.cpu()[keep])
    device_cache = on_device(cache)
    kernels.write_kv(on_device(key), on_device(value), device_cache, slots)
    assert torch.equal(device_cache.cpu().view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))  # something was written
    untouched = meta.slot_mapping[2].item()
    assert torch.equal(device_cache.cpu().view(torch.uint8).flatten(1, 2)[:, untouched],
                       cache.view(torch.uint8).flatten(1, 2)[:, untouched])


def test_kernel_class_over_a_quantized_cache():
    spec = make_spec(group=3, block_size=16, dtype=torch.bfloat16, sliding_window=12, kv_cache_dtype="fp8_e4m3fn")
    meta, cache, query = random_step(spec, [(1, 30), (1, 4), (10, 25), (4, 4)], seed=11)
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(query.shape[0], 2, 64, generator=gen).to(DEVICE, spec.dtype) for _ in range(2))
    expected_cache = cache.cpu().clone()
    ReferenceAttentionKernel(spec).write_kv(key.cpu(), value.cpu(), expected_cache, dataclasses.replace(
        meta, slot_mapping=meta.slot_mapping.cpu()))
    kernel = TritonAttentionKernel(spec)
    kernel.write_kv(key, value, cache, meta)
    assert torch.equal(cache.cpu().view(torch.uint8), expected_cache.view(torch.uint8))
    torch.testing.assert_close(kernel.forward(query, cache, meta).cpu(), reference(spec, meta, cache, query),
                               **TOLERANCE[spec.dtype])


def test_static_tile_and_split_choices():
    assert kernels.choose_num_kv_splits(num_requests=1, num_kv_heads=8, max_query_len=1, num_sms=132) == 64
    assert kernels.choose_num_kv_splits(num_requests=64, num_kv_heads=8, max_query_len=1, num_sms=132) == 1
    assert kernels.choose_num_kv_splits(num_requests=1, num_kv_heads=8, max_query_len=5, num_sms=132) == 1
    for group in (1, 3, 4, 8, 32):
        for max_query_len in (1, 7, 300):
            tiles = kernels.tile_shape(group, max_query_len)
            assert tiles.block_m >= 16 and tiles.block_m & (tiles.block_m - 1) == 0
            assert tiles.block_q * group <= tiles.block_m and tiles.block_q >= 1
    with pytest.raises(ValueError, match="power of two"):
        spec = make_spec(group=1, block_size=8)
        meta, cache, query = random_step(spec, [(1, 3)], seed=0)
        triton_attention(spec, meta, cache, query, num_kv_splits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 576])
def test_rms_norm_with_and_without_residual(dtype, hidden_size):
    gen = torch.Generator().manual_seed(hidden_size)
    norm = RMSNorm(hidden_size, eps=1e-5, dtype=dtype)
    norm.weight.data = (1 + torch.randn(hidden_size, generator=gen)).to(dtype)
    x, residual = (torch.randn(5, hidden_size, generator=gen).to(dtype) for _ in range(2))
    tol = TOLERANCE[dtype]
    out = kernels.rms_norm(on_device(x), on_device(norm.weight), 1e-5)
    torch.testing.assert_close(out.cpu(), norm(x), **tol)
    device_residual = on_device(residual)
    out, updated = kernels.rms_norm(on_device(x), on_device(norm.weight), 1e-5, residual=device_residual)
    assert updated is device_residual
    torch.testing.assert_close(updated.cpu(), x + residual, **tol)
    torch.testing.assert_close(out.cpu(), norm(x + residual), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_apply_rotary_on_a_strided_view_and_in_place(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([0, 1, 2, 3, 17, 400, 5])
    cos, sin = RotaryEmbedding(head_dim, 10000.0)(positions, dtype)
    qkv = torch.randn(7, 4 + 2 + 2, head_dim, generator=gen).to(dtype)  # q and k heads of a fused projection
    qk = qkv[:, :6]
    expected = apply_rotary(qk, cos, sin)
    device_qkv = on_device(qkv)
    out = kernels.apply_rotary(device_qkv[:, :6], on_device(cos), on_device(sin))
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])
    kernels.apply_rotary(device_qkv[:, :6], cos.to(DEVICE), sin.to(DEVICE), out=device_qkv[:, :6])
    torch.testing.assert_close(device_qkv[:, :6].cpu(), expected, **TOLERANCE[dtype])
    assert torch.equal(device_qkv[:, 6:].cpu(), qkv[:, 6:])  # values untouched
    assert not torch.allclose(expected[1:], qk[1:], atol=1e-2)  # the positions really rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate_size", [48, 1536])
def test_silu_and_mul(dtype, intermediate_size):
    x = torch.randn(3, 2 * intermediate_size, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    torch.testing.assert_close(kernels.silu_and_mul(on_device(x)).cpu(), SiluAndMul()(x), **TOLERANCE[dtype])


def test_importing_the_cuda_attention_module_does_not_import_triton():
    code = "import sys, switchyard.backends.cuda.attention; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(RUNS_HERE, reason="the kernels run in this process")
def test_in_a_fresh_process_if_triton_was_imported_too_early():
    rerun_in_fresh_process(__file__)
