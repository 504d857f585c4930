"""The CPU backend's linear layers: oneDNN-packed weights and the single-row product choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from switchyard.backends.cpu import linear as linear_module
from switchyard.backends.cpu.linear import PackedLinear, pack_linears, packable_dtypes, packing_supported
from switchyard.backends.cpu.tuning import choose_single_row_products, matvec_is_faster
from switchyard.core.layers import Linear, MergedLinear
from switchyard.core.layers.linear import linear

needs_packing = pytest.mark.skipif(not packing_supported(), reason="this torch has no oneDNN linear packing")
needs_bf16_packing = pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN packs no bf16 on this CPU")
# bf16 packing needs AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU packs bf16 weights as float32
PACKED_DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _filled(module: Linear, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    module.weight.data.copy_(torch.randn(module.weight.shape, generator=gen))
    if module.bias is not None:
        module.bias.data.copy_(torch.randn(module.bias.shape, generator=gen))
    return module


@needs_packing
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_packed_linear_matches_f_linear(dtype, bias, rows):
    plain = _filled(Linear(40, 24, bias=bias, dtype=dtype))
    packed = PackedLinear(plain.weight, plain.bias)
    x = torch.randn(rows, 40).to(dtype)
    with torch.inference_mode():
        out = packed(x)
    assert out.shape == (rows, 24) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, plain.weight, plain.bias), **TOLERANCE[dtype])


@needs_packing
@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="this CPU cannot pack bf16 weights")
@pytest.mark.parametrize("one_packing", [True, False])
def test_bf16_keeps_one_packing_only_where_it_serves_single_rows(one_packing, monkeypatch):
    """Packed for BF16_BATCH_HINT rows; a second packing for one row only where this CPU
    measured the batch packing slower at one row (bf16_one_packing)."""
    assert isinstance(linear_module.bf16_one_packing.__wrapped__(), bool)  # the measurement itself runs
    monkeypatch.setattr(linear_module, "bf16_one_packing", lambda: one_packing)
    plain = _filled(Linear(64, 48, bias=True, dtype=torch.bfloat16))
    packed = PackedLinear(plain.weight, plain.bias)
    assert (packed._packed_one_row is packed._packed_batch) == one_packing
    for rows in (1, 5):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), F.linear(x, plain.weight, plain.bias), **TOLERANCE[torch.bfloat16])


class _TwoLayers(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.up = _filled(MergedLinear(16, (8, 8), dtype=dtype), seed=1)
        self.down = _filled(Linear(16, 16, bias=True, dtype=dtype), seed=2)
        self.head = nn.ModuleDict({"out": _filled(Linear(16, 5, dtype=dtype), seed=3)})

    def forward(self, x):
        return self.head["out"](self.down(self.up(x)))


@needs_packing
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_pack_linears_replaces_every_linear_and_keeps_the_output(dtype):
    model = _TwoLayers(dtype)
    x = torch.randn(4, 16).to(dtype)
    with torch.inference_mode():
        expected = model(x)
        assert pack_linears(model) == 3
        out = model(x)
    assert all(not isinstance(m, Linear) for m in model.modules())
    assert isinstance(model.head["out"], PackedLinear)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@needs_packing
def test_bf16_is_packed_natively_or_as_float32():
    """bf16 weights are packed in bf16 where this CPU can, else as float32 (the same values),
    multiplied in float32 and rounded to bf16: the result of float32 accumulation either way."""
    model = nn.Sequential(_filled(Linear(8, 8, dtype=torch.bfloat16)))
    assert pack_linears(model) == 1 and isinstance(model[0], PackedLinear)
    inside = torch.bfloat16 if torch.bfloat16 in packable_dtypes() else torch.float32
    assert model[0]._packed_one_row.dtype == inside
    with torch.inference_mode():
        assert model(torch.randn(2, 8).bfloat16()).dtype == torch.bfloat16


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_bf16_weights_packed_as_float32_round_once(rows, monkeypatch):
    """The AVX2 path (forced here): exactly float32's product of the bf16 values, rounded once."""
    monkeypatch.setattr(linear_module, "packable_dtypes", lambda: (torch.float32,))
    plain = _filled(Linear(40, 24, bias=True, dtype=torch.bfloat16))
    packed = PackedLinear(plain.weight, plain.bias)
    assert packed._packed_batch.dtype == torch.float32 and "multiplied in torch.float32" in repr(packed)
    x = torch.randn(rows, 40).bfloat16()
    with torch.inference_mode():
        out = packed(x)
    expected = F.linear(x.float(), plain.weight.float(), plain.bias.float()).bfloat16()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=8e-3)


def test_float16_linears_are_not_packed():
    model = nn.Sequential(_filled(Linear(8, 8, dtype=torch.float16)))
    assert pack_linears(model) == 0 and isinstance(model[0], Linear)


@pytest.mark.parametrize("matvec", [None, True, False])
def test_single_row_products_agree_either_way(matvec):
    weight, row = torch.randn(12, 8).bfloat16(), torch.randn(1, 8).bfloat16()
    torch.testing.assert_close(linear(row, weight, None, matvec), F.linear(row, weight), atol=1e-2, rtol=1e-2)


def test_choose_single_row_products_sets_every_linear_by_shape():
    model = nn.Sequential(_filled(Linear(32, 16, dtype=torch.bfloat16)),
                          _filled(Linear(16, 32, dtype=torch.bfloat16)),
                          _filled(Linear(32, 16, dtype=torch.bfloat16)))
    choices = choose_single_row_products(model)
    assert set(choices) == {(16, 32, torch.bfloat16), (32, 16, torch.bfloat16)}
    assert [m.single_row_matvec for m in model] == [choices[(16, 32, torch.bfloat16)],
                                                     choices[(32, 16, torch.bfloat16)],
                                                     choices[(16, 32, torch.bfloat16)]]
    assert isinstance(matvec_is_faster(torch.randn(4, 4)), bool)


@pytest.fixture(scope="module")
def rows_ops():
    from switchyard.backends.cpu.extension import ROWS_SOURCE, build_extension
    from switchyard.core.loader.gguf_cache import default_cache_root

    build = build_extension(default_cache_root(), ROWS_SOURCE, "CPU bf16 row matmul", "none", ("bf16_rows_mm",))
    if not build.available:
        pytest.skip(f"the bf16 row kernel did not build: {build.reason}")
    return build.ops


def _rows_reference(x, weight, bias):
    """float32's product of the bf16 values, rounded once to x's dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _check_rows_kernel(ops):
    # padded tiles: N 37 (nine groups of 4 and one row), K 200 (six steps of 32 and 8 columns), N 3 K 7
    for N, K in ((37, 200), (64, 576), (3, 7)):
        gen = torch.Generator().manual_seed(N * K)
        weight = torch.randn(N, K, generator=gen).bfloat16()
        for bias in (None, torch.randn(N, generator=gen)):
            for dtype in (torch.float32, torch.bfloat16):
                for rows in (1, 3, 9):
                    x = torch.randn(rows, K, generator=gen).to(dtype)
                    out = ops.bf16_rows_mm(x, linear_module.pack_rows(weight), N, bias)
                    expected = _rows_reference(x, weight, bias)
                    assert out.shape == (rows, N) and out.dtype == dtype
                    # sums in another order: float32 rounding, then at most one bf16 step apart
                    tol = dict(atol=1e-4 * K, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
                    torch.testing.assert_close(out.float(), expected.float(), **tol)


def test_the_bf16_row_kernel_is_float32_accumulation_rounded_once(rows_ops):
    _check_rows_kernel(rows_ops)


def test_the_bf16_row_kernel_refuses_what_it_cannot_multiply(rows_ops):
    packed = linear_module.pack_rows(torch.randn(8, 40).bfloat16())  # [2, 2, 4, 32]
    assert packed.shape == (2, 2, 4, 32)
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        rows_ops.bf16_rows_mm(torch.randn(1, 40), packed.float(), 8, None)
    with pytest.raises(RuntimeError, match="pack_rows"):
        rows_ops.bf16_rows_mm(torch.randn(1, 40), torch.randn(8, 40).bfloat16(), 8, None)
    for width, out_features in ((32, 8), (65, 8), (40, 4), (40, 9)):
        with pytest.raises(RuntimeError, match="must match the packed weight"):
            rows_ops.bf16_rows_mm(torch.randn(1, width), packed, out_features, None)
    for bias in (torch.randn(8).half(), torch.randn(9)):
        with pytest.raises(RuntimeError, match="float32 or bfloat16 bias"):
            rows_ops.bf16_rows_mm(torch.randn(1, 40), packed, 8, bias)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_the_bf16_row_kernel_on_other_instruction_sets(variant, tmp_path):
    """The loops an AVX2-only CPU builds (vec16.h's pairs of 8-lane registers) and the portable one."""
    from kernel_variants import build_variant

    from switchyard.backends.cpu.extension import ROWS_SOURCE

    ops = build_variant(ROWS_SOURCE, variant, tmp_path)
    assert ops.rows_mm_isa() == variant
    _check_rows_kernel(ops)


class _CountingRowsOps:
    def __init__(self, ops):
        self.ops, self.calls = ops, 0

    def bf16_rows_mm(self, *args):
        self.calls += 1
        return self.ops.bf16_rows_mm(*args)


def test_the_row_kernel_serves_few_rows_of_bf16_weights_wherever_float32_packs(monkeypatch):
    for dtypes, rows in (((torch.float32,), linear_module.ROWS_BESIDE_FLOAT32),
                         ((torch.float32, torch.bfloat16), linear_module.ROWS_BESIDE_BF16), ((), 0)):
        monkeypatch.setattr(linear_module, "packable_dtypes", lambda dtypes=dtypes: dtypes)
        assert linear_module.rows_kernel_rows(torch.bfloat16) == rows
        assert linear_module.rows_kernel_rows(torch.float32) == 0


def _check_row_kernel_routing(bias, rows_ops, packed_dtype):
    plain = _filled(Linear(40, 24, bias=bias, dtype=torch.bfloat16))
    counting = _CountingRowsOps(rows_ops)
    packed = PackedLinear(plain.weight, plain.bias, counting)
    limit = linear_module.rows_kernel_rows(torch.bfloat16)
    assert packed.rows_limit == limit > 0 and packed._packed_batch.dtype == packed_dtype
    assert packed._rows_weight.shape == (6, 2, 4, 32) and "bf16 row kernel" in repr(packed)
    assert packed._packed_one_row is packed._packed_batch  # single rows never reach a one-row packing
    for rows in (1, limit, limit + 1, 33):
        x = torch.randn(rows, 40).bfloat16()
        before = counting.calls
        with torch.inference_mode():
            out = packed(x)
        assert (counting.calls > before) == (rows <= limit)
        expected = _rows_reference(x, plain.weight, plain.bias)
        torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=8e-3)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_without_bf16_packing_take_the_row_kernel_for_few_rows(bias, rows_ops, monkeypatch):
    """The AVX2 path (forced here): up to ROWS_BESIDE_FLOAT32 rows through the row kernel on the
    bf16 weight, more through the float32 packing; the same products either way."""
    monkeypatch.setattr(linear_module, "packable_dtypes", lambda: (torch.float32,))
    _check_row_kernel_routing(bias, rows_ops, torch.float32)


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_beside_a_bf16_packing_take_the_row_kernel_for_one_or_two_rows(bias, rows_ops):
    """AVX-512 BF16: up to ROWS_BESIDE_BF16 rows through the row kernel, more through oneDNN's bf16
    packing (a bf16 bias as it is)."""
    _check_row_kernel_routing(bias, rows_ops, torch.bfloat16)
