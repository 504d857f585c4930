"""The CPU kernel against the plain-torch reference on ragged, paged batches: the gather
path, and the in-place C++ decode kernel (built once into the default cache root, as
an engine start would; the first build takes about a minute). Float caches, and quantized ones
(--kv-cache-dtype int8, fp8_e4m3fn, fp8_e5m2) against the reference over the same codes, on every
instruction-set level this CPU runs."""
from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch

from switchyard.backends.cpu import CpuAttentionKernel, CpuBackend, StepPlanCache
from switchyard.backends.cpu import attention as cpu_attention
from switchyard.backends.cpu import extension
from switchyard.backends.cpu.extension import PagedDecode
from switchyard.backends.cpu.backend import IN_PLACE_MAX_DECODES
from switchyard.core.backend import KV_CACHE_FORMATS, AttentionMetadata, AttentionSpec
from switchyard.core.kv.quantized import quantize_rows
from switchyard.core.ops.attention import paged_attention_reference, write_kv_reference

HEAD_DIM = 16
NUM_KV_HEADS = 2


def make_meta(lens: list[tuple[int, int]], num_decodes: int, block_size: int, num_blocks: int,
              rng: random.Random) -> AttentionMetadata:
    """lens: (query_len, seq_len) per request, decodes first. Block ids are random,
    non-contiguous, distinct across requests, and never 0 (the reserved block)."""
    needed = [-(-seq_len // block_size) for _, seq_len in lens]
    ids = rng.sample(range(1, num_blocks), sum(needed))
    width = max(needed, default=0) + 1  # one column of 0-padding even for the longest request
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    slots, starts = [], [0]
    for row, ((q_len, seq_len), count) in enumerate(zip(lens, needed)):
        table[row, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(table[row, pos // block_size]) * block_size + pos % block_size)
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32),
        block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.long), num_decodes=num_decodes,
        max_query_len=max((q for q, _ in lens), default=0), max_seq_len=max((s for _, s in lens), default=0),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(s for _, s in lens))


def ragged_batch(rng: random.Random, block_size: int) -> tuple[list[tuple[int, int]], int]:
    decodes = [(1, rng.randint(1, 5 * block_size)) for _ in range(rng.randint(1, 5))]
    chunks = [(q, q + rng.choice([0, rng.randint(1, 3 * block_size)])) for q in
              (rng.randint(2, 2 * block_size + 3) for _ in range(rng.randint(1, 3)))]
    chunks.append((7, 7))  # a whole prompt with no cached prefix
    return decodes + chunks, len(decodes)


@pytest.fixture(scope="session")
def in_place() -> PagedDecode:
    """The in-place decode kernel, built (or reused) where the engine keeps it."""
    from switchyard.core.loader.gguf_cache import default_cache_root

    decode = PagedDecode()
    build = decode.load(default_cache_root())
    assert build is not None and build.available, build.reason
    return decode


@pytest.fixture(params=["gather", "in_place"])
def decode_path(request) -> PagedDecode | None:
    return request.getfixturevalue("in_place") if request.param == "in_place" else None


def run_both(lens, num_decodes, spec: AttentionSpec, seed: int, num_blocks: int = 64,
             decode: PagedDecode | None = None):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    meta = make_meta(lens, num_decodes, spec.block_size, num_blocks, rng)
    num_tokens = meta.query_start_loc_cpu[-1]
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.randn(shape, generator=gen).to(spec.dtype)  # cached prefixes (and garbage elsewhere)
    if spec.quantized_cache:  # the same rows, quantized (--kv-cache-dtype)
        cache = quantize_rows(cache, spec.cache_dtype).view(spec.cache_dtype)
    ref_cache = cache.clone()
    query = torch.randn(num_tokens, spec.num_heads, spec.head_dim, generator=gen).to(spec.dtype)
    key = torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, generator=gen).to(spec.dtype)
    value = torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, generator=gen).to(spec.dtype)

    kernel = CpuAttentionKernel(spec, decode=decode)
    kernel.write_kv(key, value, cache, meta)
    write_kv_reference(key, value, ref_cache, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))  # a quantized cache's bytes too
    out = kernel.forward(query, cache, meta)
    expected = paged_attention_reference(query, ref_cache, list(meta.query_start_loc_cpu), list(meta.seq_lens_cpu),
                                         meta.block_table, spec.scale, spec.sliding_window, spec.soft_cap)
    return out, expected


TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (19, None), (None, 2.0), (11, 3.0)])
def test_matches_reference_on_ragged_batches(dtype, block_size, group, window, soft_cap, decode_path):
    """Mixed batches (decodes, prompt chunks with and without a cached prefix) through forward."""
    seed = zlib.crc32(repr((dtype, block_size, group, window, soft_cap)).encode()) % 10_000
    lens, num_decodes = ragged_batch(random.Random(seed), block_size)
    spec = AttentionSpec(num_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                         block_size=block_size, scale=HEAD_DIM ** -0.5, dtype=dtype,
                         sliding_window=window, soft_cap=soft_cap)
    out, expected = run_both(lens, num_decodes, spec, seed, decode=decode_path)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("lens,num_decodes", [
    ([(1, 1), (1, 9), (1, 40)], 3),  # only decodes
    ([(12, 12), (5, 30)], 0),  # only prompt chunks
    ([(1, 17), (33, 33)], 1),  # a long prompt without prefix next to a decode
])
def test_batch_shapes(lens, num_decodes):
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.3)
    out, expected = run_both(lens, num_decodes, spec, seed=7)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_many_decodes_match_reference_across_row_groups(dtype, window, decode_path):
    """35 decodes: gathered, two full row groups on the matmul path (bf16) and a 3-row rest on SDPA."""
    assert cpu_attention.DECODE_ROWS_PER_GROUP == 16 and cpu_attention.MIN_ROWS_FOR_MATMUL_DECODES == 4
    rng = random.Random(3)
    lens = [(1, rng.randint(1, 60)) for _ in range(35)] + [(9, 20)]
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.3, dtype=dtype,
                         sliding_window=window)
    out, expected = run_both(lens, 35, spec, seed=11, num_blocks=512, decode=decode_path)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_soft_cap_and_window_change_the_result():
    """Guards the tests above: the cases they cover really differ from plain causal attention."""
    lens = [(1, 30), (9, 25)]
    base = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=1.0)
    plain, _ = run_both(lens, 1, base, seed=3)
    for variant in (dict(soft_cap=2.0), dict(sliding_window=5)):
        spec = AttentionSpec(**{**base.__dict__, **variant})
        out, expected = run_both(lens, 1, spec, seed=3)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
        assert not torch.allclose(out, plain, atol=1e-3)


def test_plan_is_shared_by_layers_and_rebuilt_per_step():
    backend = CpuBackend()
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.25)
    layers = [backend.attention(spec) for _ in range(3)]
    meta = make_meta([(1, 10), (4, 12)], 1, 8, 16, random.Random(0))
    plans = backend._plans
    first = plans.get(meta, 8, None, torch.float32, 2)
    assert all(layer._plans is plans for layer in layers)
    assert plans.get(meta, 8, None, torch.float32, 2) is first
    next_meta = make_meta([(1, 11), (4, 12)], 1, 8, 16, random.Random(0))
    assert plans.get(next_meta, 8, None, torch.float32, 2) is not first


def test_empty_batch():
    spec = AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.25)
    meta = make_meta([], 0, 8, 4, random.Random(0))
    out = CpuAttentionKernel(spec, StepPlanCache()).forward(torch.empty(0, 2, HEAD_DIM), torch.zeros(2, 4, 8, 2,
                                                                                                    HEAD_DIM), meta)
    assert out.shape == (0, 2, HEAD_DIM)


def test_write_kv_casts_into_cache_dtype():
    spec = AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.25,
                         dtype=torch.bfloat16)
    meta = make_meta([(3, 3)], 0, 8, 4, random.Random(1))
    cache = torch.zeros(2, 4, 8, 2, HEAD_DIM, dtype=torch.bfloat16)
    key, value = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    CpuAttentionKernel(spec).write_kv(key, value, cache, meta)
    flat = cache.view(2, -1, 2, HEAD_DIM)
    assert torch.equal(flat[0, meta.slot_mapping], key.to(torch.bfloat16))
    assert torch.equal(flat[1, meta.slot_mapping], value.to(torch.bfloat16))


def test_grouped_query_attention_without_native_sdpa_support(monkeypatch):
    """torch < 2.5 lacks SDPA's enable_gqa: prompt chunks then expand K/V instead."""
    import switchyard.backends.cpu.attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "sdpa_supports_gqa", lambda: False)
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.3)
    assert not CpuAttentionKernel(spec)._native_gqa
    out, expected = run_both([(1, 20), (9, 30), (6, 6)], 1, spec, seed=11)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_kernel_works_inside_and_outside_inference_mode():
    """The scratch buffer and plans are shared across steps; the engine runs under
    inference mode, tests and tools may not."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.3)
    kernel, cache = CpuAttentionKernel(spec), torch.randn(2, 16, 8, 2, HEAD_DIM)
    meta, query = make_meta([(1, 10), (4, 12)], 1, 8, 16, random.Random(0)), torch.randn(5, 4, HEAD_DIM)
    with torch.inference_mode():
        inside = kernel.forward(query, cache, meta)
    assert torch.equal(kernel.forward(query, cache, meta), inside)


# ---- the in-place decode kernel (csrc/paged_decode.cpp) ----

IN_PLACE_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
                      # both round a float32 result to bf16 once: at most about one bf16 ulp apart
                      torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def _no_gather(*args, **kwargs):
    raise AssertionError("decodes were gathered instead of read in place")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (7, None), (None, 2.0), (13, 3.0)])
def test_in_place_decodes_match_reference(in_place, monkeypatch, dtype, block_size, group, window, soft_cap):
    """Decode-only batches, contexts on and across block boundaries, never gathered."""
    monkeypatch.setattr(CpuAttentionKernel, "_gather", _no_gather)
    lens = [(1, n) for n in (1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 5 * block_size, 97)]
    spec = AttentionSpec(num_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=64,
                         block_size=block_size, scale=0.125, dtype=dtype, sliding_window=window, soft_cap=soft_cap)
    out, expected = run_both(lens, len(lens), spec, seed=block_size * 10 + group, num_blocks=128, decode=in_place)
    torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


def anchored_step(window: int, dtype: torch.dtype, group: int = 3, block_size: int = 8):
    """An image chunk's rows as core/multimodal/image_rows.py lays them out (positions 10-17, an
    image at 12-17: its rows' seq_len 18, their anchors their own positions), beside plain decodes
    (one of 700 positions anchored at 450, split into ranges by the C++ kernel) and a prompt chunk,
    whose anchors are seq_len - 1 (AttentionMetadata.window_anchors). Returns the spec, the
    metadata with anchors, the cache after this step's writes, and the query."""
    rows = [(1, p + 1) if p < 12 else (1, 18) for p in range(10, 18)]
    lens = rows + [(1, 40), (1, 700), (6, 20)]
    anchors = list(range(10, 18)) + [39, 450, 19]
    spec = AttentionSpec(num_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=64,
                         block_size=block_size, scale=0.125, dtype=dtype, sliding_window=window)
    num_blocks = 160
    meta = make_meta(lens, len(lens) - 1, block_size, num_blocks, random.Random(window))
    meta = dataclasses.replace(meta, window_anchors=torch.tensor(anchors, dtype=torch.int32),
                               window_anchors_cpu=tuple(anchors))
    gen = torch.Generator().manual_seed(window)
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, 64, generator=gen).to(dtype)
    num_tokens = meta.query_start_loc_cpu[-1]
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, 64, generator=gen).to(dtype) for _ in range(2))
    write_kv_reference(key, value, cache, meta.slot_mapping)
    query = torch.randn(num_tokens, spec.num_heads, 64, generator=gen).to(dtype)
    return spec, meta, cache, query


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [5, 300])
def test_window_anchors_on_the_gather_path_and_in_place(in_place, dtype, window):
    """Per-row window anchors in a sliding layer: the gather path, the C++ kernel and the reference
    agree, and differ from the same step without anchors where the anchors move a window."""
    spec, meta, cache, query = anchored_step(window, dtype)
    args = (list(meta.query_start_loc_cpu), list(meta.seq_lens_cpu), meta.block_table, spec.scale, window)
    expected = paged_attention_reference(query, cache, *args, window_anchors=list(meta.window_anchors_cpu))
    for decode in (None, in_place):
        calls = []
        kernel = CpuAttentionKernel(spec, decode=decode)
        if decode is not None:  # the decodes go through the C++ kernel, given the anchors
            op = decode.op
            kernel._decode = PagedDecode()
            kernel._decode.build = dataclasses.replace(decode.build, op=lambda *a: (calls.append(a[-1]), op(*a)))
        out = kernel.forward(query, cache, meta)
        torch.testing.assert_close(out, expected, **(TOLERANCE if decode is None else IN_PLACE_TOLERANCE)[dtype])
        assert decode is None or torch.equal(calls[0], meta.window_anchors)
    plain = paged_attention_reference(query, cache, *args)
    moved = [i for i, (a, s) in enumerate(zip(meta.window_anchors_cpu, meta.seq_lens_cpu))
             if max(0, a + 1 - window) != max(0, s - window)]  # the rows whose first key the anchor moves
    assert len(moved) == (6 if window == 5 else 1)
    still = [i for i in range(len(query)) if i not in moved]
    assert (plain[moved] - expected[moved]).abs().amax(dim=(1, 2)).min() > 0.05  # every moved window counts
    torch.testing.assert_close(plain[still], expected[still], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the two specialised head dims, the generic AVX-512 code (80) and the portable loops (72: not a multiple of 16)
@pytest.mark.parametrize("head_dim", [64, 128, 80, 72])
def test_in_place_kernel_on_many_requests_with_a_strided_query(in_place, dtype, head_dim):
    """48 requests of ~200 tokens, 9 query heads on 3 KV heads (SmolLM2's shapes at head_dim
    64); the query is a column slice of a fused projection (rows not contiguous), as a model
    may hand it over."""
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    lens = [(1, rng.randint(150, 250)) for _ in range(48)]
    meta = make_meta(lens, 48, 16, 1024, rng)
    cache = torch.randn(2, 1024, 16, 3, head_dim, generator=gen).to(dtype)
    fused = torch.randn(48, 15, head_dim, generator=gen).to(dtype)  # q (9 heads), k (3), v (3)
    query = fused[:, :9]
    assert not query.is_contiguous()
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=head_dim, block_size=16, scale=0.125, dtype=dtype)
    out = CpuAttentionKernel(spec, decode=in_place).forward(query, cache, meta)
    expected = paged_attention_reference(query, cache, list(meta.query_start_loc_cpu), list(meta.seq_lens_cpu),
                                         meta.block_table, 0.125)
    torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 64, 256])
def test_in_place_kernel_on_every_block_size(in_place, monkeypatch, dtype, block_size):
    """Tiles of 16 positions straddle small blocks and cut large ones; with a window, tiles
    start mid-block."""
    monkeypatch.setattr(CpuAttentionKernel, "_gather", _no_gather)
    lens = [(1, n) for n in (1, 15, 16, 17, 40, 300, 513)]
    for window in (None, 37):
        spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size, scale=0.125,
                             dtype=dtype, sliding_window=window)
        num_blocks = sum(-(-n // block_size) for _, n in lens) + 8
        out, expected = run_both(lens, len(lens), spec, seed=block_size, num_blocks=num_blocks, decode=in_place)
        torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (700, None), (None, 5.0)])
def test_in_place_kernel_splits_few_long_requests(in_place, dtype, threads, window, soft_cap):
    """Fewer requests than 4 per thread: each request's positions are split into ranges
    attended by different tasks and merged (flash-decoding split-KV); lengths that leave a
    short last range, and one shorter than a range."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [(1, 2049), (1, 1000), (1, 50)]
        spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, scale=0.125, dtype=dtype,
                             sliding_window=window, soft_cap=soft_cap)
        out, expected = run_both(lens, len(lens), spec, seed=threads, num_blocks=256, decode=in_place)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


@pytest.mark.parametrize("threads", [2, 3])
def test_in_place_kernel_shares_uneven_requests_between_threads(in_place, threads):
    """Threads take contiguous runs of requests of about equal positions (not equal counts):
    long contexts first, then many short ones, and one empty share when there are fewer
    requests than threads would get."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [(1, 700), (1, 650)] + [(1, 3 + i) for i in range(14)]
        spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, scale=0.125,
                             dtype=torch.bfloat16)
        out, expected = run_both(lens, len(lens), spec, seed=threads, num_blocks=160, decode=in_place)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[torch.bfloat16])


@pytest.mark.slow
def test_second_start_reuses_the_build(in_place):
    """A new process finds the binary built by the first one: nothing is compiled."""
    import subprocess
    import sys

    from switchyard.core.loader.gguf_cache import default_cache_root

    build = in_place.build
    binary = f"{build.directory}/{build.directory.rsplit('/', 1)[1]}.so"
    built_at = __import__("os").stat(binary).st_mtime_ns
    script = ("from switchyard.backends.cpu.extension import build_paged_decode as b; "
              f"r = b({default_cache_root()!r}); print(r.available, r.cache_hit, r.seconds, r.directory)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    available, cache_hit, seconds, directory = result.stdout.split()
    assert (available, cache_hit, directory) == ("True", "True", build.directory), result.stderr
    assert __import__("os").stat(binary).st_mtime_ns == built_at  # a cache hit, not rebuilt (seconds vary with load)


def test_failed_build_falls_back_to_the_gather_path(tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error deliberately broken\n")
    decode = PagedDecode()
    with caplog.at_level("WARNING", logger=extension.__name__):
        build = decode.load(str(tmp_path / "cache"), str(broken))
    assert not build.available and decode.op is None
    assert "build failed" in build.reason and "deliberately broken" in build.reason
    assert [r.getMessage() for r in caplog.records if "gather path" in r.getMessage()] != []
    assert decode.describe(str(tmp_path / "cache")).startswith("gather path (build failed")
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.3)
    out, expected = run_both([(1, 20), (1, 9), (9, 30)], 2, spec, seed=4, decode=decode)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_a_binary_without_the_kernel_op_falls_back_to_the_gather_path(tmp_path):
    """It compiles and loads but registers no paged_decode (as under another torch's ABI)."""
    empty = tmp_path / "no_ops.cpp"
    empty.write_text("int switchyard_nothing_here() { return 0; }\n")
    decode = PagedDecode()
    build = decode.load(str(tmp_path / "cache"), str(empty))
    assert not build.available and decode.op is None and decode.op_name is None
    assert build.reason.startswith("build failed (AttributeError") and "paged_decode" in build.reason


def test_no_compiler_means_the_gather_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    decode = PagedDecode()
    assert decode.describe(str(tmp_path)).startswith("gather path (no C++ compiler")
    build = decode.load(str(tmp_path))
    assert not build.available and build.reason.startswith("no C++ compiler") and decode.op is None


def test_backend_reports_the_decode_path(in_place):
    from switchyard.core.loader.gguf_cache import default_cache_root

    assert "decodes: gather path (forced)" in CpuBackend(in_place_decode=False).capabilities().attention_impl
    assert "decodes: in-place paged kernel" in CpuBackend().capabilities().attention_impl  # what a start would do
    backend = CpuBackend()
    backend._decode.load(default_cache_root())
    assert f"in-place paged kernel (C++ extension, {in_place.build.directory})" in backend.attention_impl()
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, block_size=8, scale=0.3)
    assert backend.attention(spec)._decode is backend._decode
    assert CpuBackend(in_place_decode=False).attention(spec)._decode.op is None


def test_every_decode_step_is_attended_in_place(in_place):
    """The backend sets no cap (IN_PLACE_MAX_DECODES, measured); a PagedDecode with one sends
    larger steps to the gather path and describes the limit."""
    from switchyard.core.loader.gguf_cache import default_cache_root

    assert IN_PLACE_MAX_DECODES is None
    backend = CpuBackend()
    backend._decode.load(default_cache_root())
    assert backend._decode.serves(1) and backend._decode.serves(512) and not backend._decode.serves(0)
    capped = PagedDecode(max_decodes=4)
    capped.load(default_cache_root())
    assert capped.serves(4) and not capped.serves(5)
    assert "in-place paged kernel for steps of up to 4 decodes" in capped.describe(default_cache_root())


@pytest.mark.slow
def test_engine_decodes_in_place_with_the_same_tokens(tmp_path):
    """Through the real engine (a tiny Llama, SmolLM2's head_dim 64 and group 3, several blocks
    per request): the backend
    builds the kernel at warm-up, the decode steps read the cache in place, and greedy
    tokens equal those of the forced gather path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.params import SamplingParams
    from switchyard.core.scheduling.request import Request

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    engine_config = EngineConfig(model=ModelConfig(model=str(tmp_path)), backend="cpu",
                                 cache=CacheConfig(block_size=8, num_blocks=64))
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [1, 7, 3], list(range(1, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs, in_place_calls = [], []
    for backend in (CpuBackend(), CpuBackend(in_place_decode=False)):
        engine = EngineCore(engine_config, backend=backend)
        if backend._decode.op is not None:
            op = backend._decode.op
            backend._decode.build = dataclasses.replace(
                backend._decode.build, op=lambda *args: (in_place_calls.append(1), op(*args)))
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"r{i}", prompt, params))
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
        outputs.append(tokens)
    assert len(in_place_calls) >= 2 * 19  # both layers, every decode step
    assert outputs[0] == outputs[1] and all(len(t) == 20 for t in outputs[0].values())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_other_instruction_sets_attend_the_same(variant, tmp_path):
    """The kernel as an AVX2-only CPU builds it (vec16.h's pairs of 8-lane registers) and as
    the portable loops: both head dims that are specialised, a generic one, GQA, a window and a
    soft cap, float32 and bfloat16 caches."""
    from kernel_variants import build_variant

    ops = build_variant(extension.SOURCE, variant, tmp_path)
    rng = random.Random(3)
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim, group, window, soft_cap in ((64, 3, None, None), (128, 1, 37, None), (80, 4, None, 5.0)):
            gen = torch.Generator().manual_seed(head_dim)
            lens = [(1, n) for n in (1, 15, 16, 17, 97, 300)]
            meta = make_meta(lens, len(lens), 16, 64, rng)
            cache = torch.randn(2, 64, 16, 2, head_dim, generator=gen).to(dtype)
            query = torch.randn(len(lens), 2 * group, head_dim, generator=gen).to(dtype)
            out = torch.empty_like(query)
            ops.paged_decode(out, query, cache, meta.block_table, meta.seq_lens, 0.125, window or 0, soft_cap or 0.0)
            expected = paged_attention_reference(query, cache, list(meta.query_start_loc_cpu), list(meta.seq_lens_cpu),
                                                 meta.block_table, 0.125, window, soft_cap)
            torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


# ---- quantized KV caches (--kv-cache-dtype): the reference reads the same codes as values ----

KV_FORMATS = sorted(KV_CACHE_FORMATS)


@pytest.mark.parametrize("kv_cache_dtype", KV_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,group", [(8, 1), (16, 3), (32, 4)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (11, 3.0)])
def test_quantized_caches_match_reference_on_ragged_batches(kv_cache_dtype, dtype, block_size, group, window, soft_cap,
                                                            decode_path):
    """write_kv stores quantize_rows' bytes (run_both checks them); decodes in place or gathered and
    prompt chunks gathered attend over code * scale as the reference does."""
    seed = zlib.crc32(repr((kv_cache_dtype, dtype, block_size, group, window, soft_cap)).encode()) % 10_000
    lens, num_decodes = ragged_batch(random.Random(seed), block_size)
    spec = AttentionSpec(num_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                         block_size=block_size, scale=HEAD_DIM ** -0.5, dtype=dtype, sliding_window=window,
                         soft_cap=soft_cap, kv_cache_dtype=kv_cache_dtype)
    out, expected = run_both(lens, num_decodes, spec, seed, decode=decode_path)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("kv_cache_dtype", KV_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the specialised head dims, the generic vector code (80) and the portable loops (72)
@pytest.mark.parametrize("head_dim", [64, 128, 80, 72])
def test_in_place_decodes_read_quantized_caches(in_place, monkeypatch, kv_cache_dtype, dtype, head_dim):
    """Decode-only batches over a quantized cache, read in place (never gathered): contexts on and
    across block boundaries, long ones split into ranges, GQA groups of 3."""
    monkeypatch.setattr(CpuAttentionKernel, "_gather", _no_gather)
    lens = [(1, n) for n in (1, 15, 16, 17, 97, 300, 700)]
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=head_dim, block_size=16, scale=0.125, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype)
    out, expected = run_both(lens, len(lens), spec, seed=head_dim, num_blocks=96, decode=in_place)
    torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


def test_a_quantized_cache_changes_the_result_within_its_rounding(in_place):
    """Guards the tests above: over a quantized cache the output is not the float cache's, but
    within the format's rounding of it (e5m2's 2 mantissa bits the furthest)."""
    lens = [(1, 40), (1, 130), (9, 25)]
    base = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, scale=0.125)
    plain, _ = run_both(lens, 2, base, seed=8, decode=in_place)
    errors = {}
    for kv_cache_dtype in KV_FORMATS:
        out, _ = run_both(lens, 2, dataclasses.replace(base, kv_cache_dtype=kv_cache_dtype), seed=8, decode=in_place)
        errors[kv_cache_dtype] = (out - plain).abs().max().item()
    assert 0 < errors["int8"] < errors["fp8_e4m3fn"] < errors["fp8_e5m2"] < 0.2, errors


@pytest.mark.slow
@pytest.mark.parametrize("variant", extension.isa_levels())
def test_every_instruction_set_reads_and_writes_quantized_caches_alike(variant, tmp_path):
    """The decode kernel as each level this CPU runs builds it (AVX-512, AVX2's pairs of 8-lane
    registers, the portable loops): over int8, e4m3fn and e5m2 caches, float32 and bfloat16
    queries, the reference's output over the same codes; and its quantize_kv_rows (the rows
    decode_layers.cpp writes) the bytes of core/kv/quantized.py, ties and zeros included."""
    from kernel_variants import build_variant

    ops = build_variant(extension.SOURCE, variant, tmp_path)
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(3000, 64, generator=gen) * torch.logspace(-6, 4, 3000).unsqueeze(1)
    values[0], values[1, 0], values[1, 1:] = 0.0, 127.0, torch.arange(63) + 0.5  # a zero row, ties at amax 127
    rng = random.Random(3)
    for kv_cache_dtype in KV_FORMATS:
        code = KV_CACHE_FORMATS[kv_cache_dtype]
        for dtype in (torch.float32, torch.bfloat16):
            rows = torch.empty(3000, 68, dtype=code)
            ops.quantize_kv_rows(values.to(dtype), rows)
            assert torch.equal(rows.view(torch.uint8), quantize_rows(values.to(dtype), code)), (kv_cache_dtype, dtype)
            for head_dim, group, window, soft_cap in ((64, 3, None, None), (128, 1, 37, None), (80, 4, None, 5.0)):
                lens = [(1, n) for n in (1, 15, 16, 17, 97, 300)]
                meta = make_meta(lens, len(lens), 16, 64, rng)
                cache = quantize_rows(torch.randn(2, 64, 16, 2, head_dim, generator=gen), code).view(code)
                query = torch.randn(len(lens), 2 * group, head_dim, generator=gen).to(dtype)
                out = torch.empty_like(query)
                ops.paged_decode(out, query, cache, meta.block_table, meta.seq_lens, 0.125, window or 0,
                                 soft_cap or 0.0)
                expected = paged_attention_reference(query, cache, list(meta.query_start_loc_cpu),
                                                     list(meta.seq_lens_cpu), meta.block_table, 0.125, window, soft_cap)
                torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


def _prompt_rows_batch(dtype, kv_cache_dtype=None, seed=11, group=3):
    """A step as the CPU runner lays a prompt chunk out (every token a decode row, core/execution/
    runner.py by_row): 40 consecutive positions of one request crossing the 256-position range
    split (more than one group of 32), a decode of another request, and 5 rows of a third whose
    block table differs from the first's only past its own positions. Two KV heads of `group`
    query heads each (the kernel takes 2 such rows at once for group 3, 4 for group 1)."""
    gen, block_size, head_dim = torch.Generator().manual_seed(seed), 16, 64
    tables = torch.zeros(47, 40, dtype=torch.int32)
    first = torch.randperm(60, generator=gen)[:40] + 1
    tables[:40] = first
    tables[40, :10] = torch.arange(61, 71)
    tables[41:46] = first
    tables[41:46, 3:] = torch.arange(71, 108)[:37]  # shares blocks 0-2 with the first request only
    lens = [230 + i for i in range(40)] + [150] + [40 + i for i in range(5)] + [1]
    tables[46, 0] = 1
    cache = torch.randn(2, 110, block_size, 2, head_dim, generator=gen)
    if kv_cache_dtype is None:
        cache = cache.to(dtype)
    else:  # the codes and a scale per row, as --kv-cache-dtype stores them
        cache = quantize_rows(cache, KV_CACHE_FORMATS[kv_cache_dtype]).view(KV_CACHE_FORMATS[kv_cache_dtype])
    query = torch.randn(len(lens), 2 * group, head_dim, generator=gen).to(dtype)
    return query, cache, tables, torch.tensor(lens, dtype=torch.int32)


def _each_alone(op, query, cache, tables, lens):
    together = torch.empty_like(query)
    op(together, query, cache, tables, lens, 0.125, 0, 0.0)
    for b in range(len(lens)):
        alone = torch.empty_like(query[b:b + 1])
        op(alone, query[b:b + 1], cache, tables[b:b + 1], lens[b:b + 1], 0.125, 0, 0.0)
        assert torch.equal(together[b:b + 1], alone), b
    return together


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_a_prompts_rows_attended_together_equal_each_alone(in_place, dtype, group):
    """A prompt chunk's rows are attended in groups that read each tile of the prefix once
    (paged_decode_simd.h attend_range_rows), several rows' tiles at a time: each row's output
    is the bits it has alone, and matches the reference."""
    query, cache, tables, lens = _prompt_rows_batch(dtype, group=group)
    out = _each_alone(in_place.op, query, cache, tables, lens)
    starts = list(range(len(lens) + 1))
    expected = paged_attention_reference(query, cache, starts, lens.tolist(), tables, 0.125)
    torch.testing.assert_close(out, expected, **IN_PLACE_TOLERANCE[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_prompt_rows_on_other_instruction_sets_equal_each_alone(variant, tmp_path):
    from kernel_variants import build_variant

    ops = build_variant(extension.SOURCE, variant, tmp_path)
    for dtype, kv in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")):
        query, cache, tables, lens = _prompt_rows_batch(dtype, kv)
        _each_alone(ops.paged_decode, query, cache, tables, lens)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3fn"])
@pytest.mark.parametrize("group", [1, 3])
def test_a_prompts_rows_on_a_quantized_cache_equal_each_alone(in_place, kv_cache_dtype, group):
    """The same for a quantized cache (each row's scale read with its codes)."""
    _each_alone(in_place.op, *_prompt_rows_batch(torch.float32, kv_cache_dtype, group=group))
