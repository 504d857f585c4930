"""The quantized KV cache's format (core/backend_contract.py KV_CACHE_FORMATS) and arithmetic
(core/kv/quantized.py): one row per token and KV head, head_dim one-byte codes and a float32
scale; rounding within the format's step; the reference attention reading it as values; the
names the command line takes, the contract's table and the sizes the engine counts."""
from __future__ import annotations

import pytest
import torch

from switchyard.core.backend import KV_CACHE_FORMATS, KV_SCALE_BYTES, AttentionSpec
from switchyard.core.config import KV_CACHE_DTYPES
from switchyard.core.kv.quantized import (QMAX, dequantize_cache, dequantize_rows, is_quantized, quantize_rows,
                                          write_rows)
from switchyard.core.ops.attention import paged_attention_reference, write_kv_reference

FORMATS = sorted(KV_CACHE_FORMATS)
# the largest error a value may take, as a share of its row's largest magnitude
STEP = {"int8": 0.5 / 127, "fp8_e4m3fn": 2.0**-4, "fp8_e5m2": 2.0**-3}


def test_the_command_line_names_are_the_contracts_formats():
    assert KV_CACHE_DTYPES[0] == "auto" and set(KV_CACHE_DTYPES[1:]) == set(KV_CACHE_FORMATS)
    assert set(QMAX) == set(KV_CACHE_FORMATS.values())


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_its_codes_and_its_scale_and_reads_back_within_a_step(name, dtype):
    code = KV_CACHE_FORMATS[name]
    x = (torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1))
         * torch.logspace(-6, 3, 50).view(50, 1, 1)).to(dtype)
    rows = quantize_rows(x, code)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 64 + KV_SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    amax = x.float().abs().amax(-1, keepdim=True)
    assert torch.equal(scale, amax / QMAX[code])  # absmax per row
    codes = rows[..., :64].view(code).float()
    assert codes.abs().max() <= QMAX[code]
    back = dequantize_rows(rows, code)
    assert ((back - x.float()).abs() <= (STEP[name] + 1e-6) * amax).all()  # and a float32 rounding
    if name == "int8":
        assert torch.equal(codes, codes.round()) and codes.abs().amax(-1).eq(127).all()  # the peak at +-127


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_of_zeros_has_scale_zero_and_each_row_is_its_own(name):
    code = KV_CACHE_FORMATS[name]
    x = torch.randn(4, 2, 16)
    x[1, 0] = 0
    rows = quantize_rows(x, code)
    assert not rows[1, 0].any() and torch.equal(dequantize_rows(rows, code)[1, 0], torch.zeros(16))
    alone = quantize_rows(x[2:3], code)
    assert torch.equal(rows[2:3], alone)  # batch invariance: a row's bytes are its own
    big = x.clone()
    big[0] *= 1000  # another row's magnitude changes nothing here
    assert torch.equal(quantize_rows(big, code)[2:], rows[2:])


def test_ties_round_to_even_as_the_kernels_do():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.0, 126.5]])  # amax 127: codes are x itself, rounded
    codes = quantize_rows(x, torch.int8)[0, :8].view(torch.int8).tolist()
    assert codes == [127, 0, 2, 2, 0, -2, 3, 126]


@pytest.mark.parametrize("name", FORMATS)
def test_the_reference_reads_a_quantized_cache_as_its_values(name):
    """write_kv_reference quantizes, paged_attention_reference attends over code * scale: the same
    output as the float reference over the dequantized cache."""
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=32, block_size=8, scale=0.2, kv_cache_dtype=name)
    gen = torch.Generator().manual_seed(2)
    cache = torch.zeros(spec.cache_shape(10), dtype=spec.cache_dtype)
    write_rows(torch.randn(80, 2, 32, generator=gen), torch.randn(80, 2, 32, generator=gen), cache, torch.arange(80))
    key, value = torch.randn(3, 2, 32, generator=gen), torch.randn(3, 2, 32, generator=gen)
    slots = torch.tensor([33, 34, 35])
    write_kv_reference(key, value, cache, slots)
    assert torch.equal(cache.view(torch.uint8).flatten(1, 2)[0, slots], quantize_rows(key, spec.cache_dtype))
    table = torch.tensor([[3, 4, 0]], dtype=torch.int32)
    query = torch.randn(3, 6, 32, generator=gen)
    out = paged_attention_reference(query, cache, [0, 3], [12], table, 0.2)
    values = dequantize_cache(cache)
    assert values.shape == (2, 10, 8, 2, 32) and is_quantized(cache) and not is_quantized(values)
    torch.testing.assert_close(out, paged_attention_reference(query, values, [0, 3], [12], table, 0.2))


@pytest.mark.parametrize("name", FORMATS)
def test_a_spec_sizes_its_cache_by_the_format(name):
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, scale=0.125)
    quantized = AttentionSpec(**{**spec.__dict__, "kv_cache_dtype": name})
    assert (spec.cache_dtype, spec.cache_row, spec.cache_block_bytes) == (torch.float32, 64, 2 * 16 * 3 * 64 * 4)
    assert quantized.cache_dtype == KV_CACHE_FORMATS[name] and quantized.cache_row == 68
    assert quantized.cache_block_bytes == 2 * 16 * 3 * 68  # 3.76x fewer bytes than float32
    assert quantized.cache_shape(5) == (2, 5, 16, 3, 68)


def test_a_spec_refuses_an_unknown_format_or_an_unaligned_head_dim():
    with pytest.raises(ValueError, match="'q4_0' is not one of auto, int8"):
        AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, scale=1.0, kv_cache_dtype="q4_0")
    with pytest.raises(ValueError, match="multiple of 4"):
        AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=30, block_size=16, scale=1.0, kv_cache_dtype="int8")
    AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=30, block_size=16, scale=1.0)  # a float cache takes any
