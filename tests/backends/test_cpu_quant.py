"""Quantized weights on the CPU: the block formats against gguf-py's own dequantization, each
kernel module against the dequantized reference of the same weights, torch.compile tracing,
int8/int4 made at load, and the refusals (one line each)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu.block_pack import SCHEMES, bits_per_weight, pack_blocks, tile_bytes, unpack_reference
from switchyard.backends.cpu.quant import BlockLinear, Int4Linear, Int8Linear, load_block_kernel
from switchyard.core.capabilities import check_capabilities
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from switchyard.core.errors import BackendCapabilityError
from switchyard.core.layers import Linear
from switchyard.core.loader import load_model
from switchyard.core.loader.gguf_cache import default_cache_root
from switchyard.core.quant import BLOCK_WEIGHTS, QuantizedWeight, quantize_int4, quantize_int8
from switchyard.core.quant.parts import QuantizedParts
from switchyard.core.testing.quant_blocks import BLOCK_FORMATS, random_blocks
from switchyard.core.quant.apply import QuantizeError, quantize_model
from switchyard.core.quant.methods import served_by
from switchyard.core.loader.gguf_packed import unpermute_rows
from kernel_variants import build_variant

# The bf16 kernels (torch's int4 and int8, and their batch path) round activations and scales
# to bf16: outputs within 1% of the largest output. The block kernel rounds activations to int8
# per 32 values: with these 5-block rows, up to 2.3% over 300 random draws (1.0-1.6% at p99);
# with its second pass (what the first lost, rounded the same way) ~1/250 of that.
BF16_TOL = 1e-2
BLOCK_TOL = {1: 3e-2, 2: 2e-4}
# The k-quants, whose d = d_super * sub-scale is a product (exact in float32; block_pack.py).
K_QUANTS = ("q4_k", "q5_k", "q6_k")


def weight_of(fmt: str, rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    """Random blocks (core/testing/quant_blocks.py) of `cols` weights a row, at scales that keep
    the weights near 1 whatever the format's block size."""
    scale = (1e-4, 3e-3) if fmt in K_QUANTS else (1e-3, 1e-1)
    return random_blocks(fmt, rows, cols // BLOCK_WEIGHTS[fmt], seed, scale)


def test_unpermute_rows_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    expected = LlamaTensorProcessor()._reverse_permute_weights(rows, 3, 3)
    assert np.array_equal(rows[unpermute_rows(24, 3).numpy()], expected)


def test_int8_and_int4_round_trip_within_their_step():
    weight = torch.randn(16, 64)
    assert (quantize_int8(weight).dequantize() - weight).abs().max() <= weight.abs().max() / 127
    int4 = quantize_int4(weight)
    assert int4.format == "q4_1"
    step = (weight.reshape(16, 2, 32).amax(-1) - weight.reshape(16, 2, 32).amin(-1)) / 15
    assert ((int4.dequantize() - weight).reshape(16, 2, 32).abs().amax(-1) <= step * 0.51 + 1e-3).all()


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [16, 40])  # 40: the last tile padded with zero rows
def test_block_tiles_hold_exactly_the_weight(fmt, rows):
    """The tiles read back (with (d, c) formed as the kernel forms them) are core's
    dequantization to the bit, the k-quants' d = d_super * sub-scale included."""
    weight = weight_of(fmt, rows, 512, seed=rows)
    packed = pack_blocks(weight)
    assert packed.data.dtype == torch.uint8 and packed.segments.tolist() == [[rows, *LAYOUT[fmt], SCHEMES[fmt], 0]]
    assert packed.data.numel() == -(-rows // 16) * tile_bytes(*LAYOUT[fmt], SCHEMES[fmt], 512 // 32)
    assert torch.equal(unpack_reference(packed), weight.dequantize())


LAYOUT = {"q4_0": (4, 32), "q4_1": (4, 32), "q4_k": (4, 32), "q5_0": (5, 32), "q5_1": (5, 32), "q5_k": (5, 32),
          "q6_k": (6, 16), "q8_0": (8, 32)}
# Bits a weight in the tiles, scales included: the file's, but a byte for each 6-bit k4 scale.
BITS_PER_WEIGHT = {"q4_0": 4.5, "q4_1": 5, "q5_0": 5.5, "q5_1": 6, "q8_0": 8.5, "q4_k": 4.625, "q5_k": 5.625,
                   "q6_k": 6.5625}


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_tiles_take_the_stated_bits_per_weight(fmt):
    assert bits_per_weight(fmt) == BITS_PER_WEIGHT[fmt]
    packed = pack_blocks(weight_of(fmt, 32, 1024))
    assert packed.data.numel() * 8 / (32 * 1024) == BITS_PER_WEIGHT[fmt]


@pytest.fixture(scope="module")
def block_ops():
    build = load_block_kernel(default_cache_root())
    if not build.available:
        pytest.skip(f"no block-format kernel here: {build.reason}")
    return build.ops


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_extensions_pack_writes_the_same_tiles(fmt, block_ops):
    """block_pack in C++ (what BlockLinear packs with) against pack_fields, the layout's
    description: the same bytes, a partial last tile and two super-blocks included."""
    weight = weight_of(fmt, 40, 512, seed=9)
    python, extension = pack_blocks(weight), pack_blocks(weight, block_ops)
    assert torch.equal(python.data, extension.data) and torch.equal(python.segments, extension.segments)
    assert torch.equal(block_ops.block_dequantize(extension.data, extension.segments, 40, 512, torch.float32),
                       weight.dequantize())


def _kernel(fmt: str, weight: QuantizedWeight, ops, bias, batch_rows, torch_int4: bool = False, passes: int = 2):
    if fmt in BLOCK_FORMATS and not torch_int4:
        return BlockLinear(weight, ops, bias, passes)
    return (Int8Linear if fmt == "int8" else Int4Linear)(weight, bias, batch_rows)


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the block kernel sees it: rounded to int8 per 32 values, scale max|x| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    # times the inverse, as the kernel does: x / scale can round a value near .5 the other way
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    q = torch.round(blocks * inverse)
    return (q * scale).reshape(x.shape)


def rounded_activations(x: torch.Tensor, passes: int) -> torch.Tensor:
    """What the kernel multiplies with `passes` passes: the int8 blocks, plus what they lost
    rounded the same way (x - int8_blocks(x), computed as the kernel computes it)."""
    first = int8_blocks(x)
    return first if passes == 1 else first + int8_blocks(x.float() - first)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 16, 35])
@pytest.mark.parametrize("passes", [1, 2])
def test_block_kernel_is_exact_on_int8_rounded_activations(fmt, rows, passes, block_ops):
    """Against the dequantized weight times the activations rounded as the kernel rounds them:
    the integer dots are exact, so only float32 summation order differs (every row-tile size;
    16 and 35 rows take AMX tiles where the CPU has them)."""
    weight = weight_of(fmt, 40, 512, seed=rows)
    x = torch.randn(rows, 512) * 3
    x[0, :32] = 0  # an all-zero block (scale 0)
    packed = pack_blocks(weight)
    out = block_ops.block_mm(x, packed.data, packed.segments, 40, passes)
    expected = rounded_activations(x, passes) @ unpack_reference(packed).T
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("passes", [1, 2])
def test_a_rows_output_does_not_depend_on_the_batch(fmt, dtype, passes, block_ops):
    """Each row of a 37-row step equals that row multiplied alone, to the bit: the loops for 1-4
    rows, AMX's 16-row tiles (with a padded last group) and VNNI's all give a row the same integer
    dots, scaled and summed in one order. Speculation's verify steps rely on it (greedy tokens
    the same as without speculation)."""
    weight = weight_of(fmt, 40, 512, seed=7)
    packed = pack_blocks(weight)
    x = (torch.randn(37, 512) * 3).to(dtype)
    together = block_ops.block_mm(x, packed.data, packed.segments, 40, passes)
    alone = torch.cat([block_ops.block_mm(x[i:i + 1], packed.data, packed.segments, 40, passes) for i in range(37)])
    assert torch.equal(together, alone)


@pytest.mark.slow
def test_amx_tiles_compute_what_vnni_computes(block_ops, tmp_path):
    """Where AMX runs (steps of block_mm_amx_rows() rows or more), its outputs equal a build
    without AMX to the bit, on every format, full and partial row groups."""
    from switchyard.backends.cpu.extension import BLOCK_SOURCE

    if block_ops.block_mm_amx_rows() == 0:
        pytest.skip("no AMX here (CPU, compiler or OS)")
    vnni = build_variant(BLOCK_SOURCE, "avx512-vnni", tmp_path)
    assert vnni.block_mm_amx_rows() == 0
    for fmt in BLOCK_FORMATS:
        weight = weight_of(fmt, 40, 256, seed=3)
        packed = pack_blocks(weight)
        for rows, passes in ((16, 1), (21, 1), (48, 1), (8, 2), (21, 2)):
            x = torch.randn(rows, 256).to(torch.bfloat16)
            assert torch.equal(block_ops.block_mm(x, packed.data, packed.segments, 40, passes),
                               vnni.block_mm(x, packed.data, packed.segments, 40, passes)), (fmt, rows)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["portable", "avx2", "avx512"])
def test_other_instruction_sets_compute_the_same(variant, tmp_path, block_ops):
    """The loops a CPU without AVX512-VNNI builds: AVX-512's vpmaddubsw tiles, AVX2's vpmaddubsw
    halves, or the portable loop (forced with SY_BLOCK_PORTABLE), on every row-tile size and a
    partial last tile: the
    same bits as this CPU's own build (one arithmetic: an answer does not change with the CPU)."""
    from switchyard.backends.cpu.extension import BLOCK_SOURCE

    ops = build_variant(BLOCK_SOURCE, variant, tmp_path)
    assert ops.block_mm_isa() == variant
    for fmt in BLOCK_FORMATS:
        weight = weight_of(fmt, 40, 256, seed=5)
        packed = pack_blocks(weight)
        reference = unpack_reference(packed)
        for rows, passes in ((1, 1), (4, 1), (5, 1), (9, 1), (17, 1), (1, 2), (5, 2)):
            x = torch.randn(rows, 256)
            expected = rounded_activations(x, passes) @ reference.T
            out = ops.block_mm(x, packed.data, packed.segments, 40, passes)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
            assert torch.equal(out, block_ops.block_mm(x, packed.data, packed.segments, 40, passes)), (variant, fmt)
            # a row's output does not depend on the rows beside it in these loops either
            alone = torch.cat([ops.block_mm(x[i:i + 1], packed.data, packed.segments, 40, passes) for i in range(rows)])
            assert torch.equal(out, alone), (variant, fmt, rows, passes)
        dequantized = ops.block_dequantize(packed.data, packed.segments, 40, 256, torch.float32)
        assert torch.equal(dequantized, reference)


@pytest.mark.parametrize("fmt", [*BLOCK_FORMATS, "int8", "torch-int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,batch_rows", [(1, None), (5, None), (5, 4), (33, 4)])
@pytest.mark.parametrize("passes", [1, 2])
def test_kernels_match_the_dequantized_reference(fmt, dtype, rows, batch_rows, passes, block_ops):
    """batch_rows: torch's kernels' batch path (the block kernel has none); passes: the block kernel's."""
    torch_int4 = fmt == "torch-int4"
    block = fmt in BLOCK_FORMATS
    if passes == 2 and not block:
        pytest.skip("one arithmetic for torch's kernels")
    fmt = "q4_1" if torch_int4 else fmt
    weight = quantize_int8(torch.randn(72, 256)) if fmt == "int8" else weight_of(fmt, 72, 256)
    bias = torch.randn(72).to(dtype)
    x = torch.randn(rows, 256).to(dtype)
    with torch.inference_mode():
        out = _kernel(fmt, weight, block_ops, bias, batch_rows, torch_int4, passes)(x)
    expected = x.float() @ weight.dequantize().T + bias.float()
    assert out.shape == (rows, 72) and out.dtype == dtype
    # the block kernel's int8 rounding, and bf16's where the activations are bf16
    tol = max(BLOCK_TOL[passes], BF16_TOL if dtype == torch.bfloat16 else 0) if block else BF16_TOL
    assert (out.float() - expected).abs().max() <= tol * expected.abs().max()


def test_parts_in_different_formats_are_one_kernel(block_ops):
    """A fused q/k/v whose parts differ (Q4_K_M: q, k Q4_K, v Q6_K): one BlockLinear of three
    segments, each multiplied in its own layout, with one pass and with two."""
    parts = QuantizedParts((weight_of("q4_k", 48, 512, 1), weight_of("q5_0", 24, 512, 2), weight_of("q6_k", 40, 512, 3)))
    expected_weight = parts.dequantize()
    for passes in (1, 2):
        module = BlockLinear(parts, block_ops, None, passes)
        assert module.segments[:, 0].tolist() == [48, 24, 40]
        x = torch.randn(5, 512)
        expected = x @ expected_weight.T
        with torch.inference_mode():
            out = module(x)
        assert (out - expected).abs().max() <= BLOCK_TOL[passes] * expected.abs().max()


def test_block_kernel_refuses_a_layout_it_has_not(block_ops):
    weight = weight_of("q4_0", 16, 64)
    packed = pack_blocks(weight)
    with pytest.raises(RuntimeError, match="no kernel for 6-bit weights in groups of 32"):
        block_ops.block_mm(torch.randn(1, 64), packed.data, torch.tensor([[16, 6, 32, 1, 0]]), 16)
    with pytest.raises(RuntimeError, match=r"groups of 32 \(scale scheme 3\)"):  # q6_k's scheme on 4 bits
        block_ops.block_mm(torch.randn(1, 64), packed.data, torch.tensor([[16, 4, 32, 3, 0]]), 16)
    with pytest.raises(RuntimeError, match="do not match out_features"):
        block_ops.block_mm(torch.randn(1, 64), packed.data, packed.segments, 32)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k", "q6_k"])
def test_kernels_trace_under_torch_compile(fmt, block_ops):
    module = _kernel(fmt, weight_of(fmt, 64, 256), block_ops, None, 1)
    x = torch.randn(2, 256)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), module(x))


def test_linear_holding_a_quantized_weight_is_its_own_reference():
    layer = Linear(64, 8)
    weight = quantize_int4(torch.randn(8, 64))
    layer.load("weight", weight)
    assert layer.quantized is weight and layer.weight.numel() == 0
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ weight.dequantize().T)


TINY = ModelConfig(model="llama-tiny", load_format="dummy")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_at_load_runs_the_kernels_and_matches_the_reference(method):
    """The CPU backend's kernels vs the same quantized weights dequantized in core (Linear's forward)."""
    from switchyard.core.testing.reference_backend import ReferenceBackend

    backend = CpuBackend()
    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", quantize=method),
                          cache=CacheConfig(num_blocks=8))
    loaded = load_model(config.model, backend, block_size=16)
    reference = load_model(config.model, ReferenceBackend(), block_size=16)
    assert loaded.model.lm_head.quantized.format == "int8"  # the head is int8 under int4 too
    backend.prepare_model(loaded, config)
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert ("BlockLinear" in kinds) == (method == "int4") and "Int8Linear" in kinds and "Linear" not in kinds
    hidden = torch.randn(5, loaded.hf_config.hidden_size)
    with torch.inference_mode():
        out, expected = loaded.model.compute_logits(hidden), reference.model.compute_logits(hidden)
    assert (out - expected).abs().max() <= BF16_TOL * expected.abs().max()


def test_quantize_model_refuses_what_is_not_made_at_load():
    with pytest.raises(QuantizeError):
        quantize_model(torch.nn.Linear(2, 2), "gguf")


def test_gguf_on_a_model_without_gguf_weights_is_refused():
    with pytest.raises(QuantizeError, match="--quantize gguf needs a GGUF model file"):
        load_model(ModelConfig(model="llama-tiny", load_format="dummy", quantize="gguf"), CpuBackend(), 16)


def test_refusals_before_loading():
    caps = CpuBackend().capabilities()
    assert caps.quantizations == served_by("cpu") and {"int8", "int4", "gguf"} <= set(caps.quantizations)
    with pytest.raises(BackendCapabilityError, match="does not support --quantize nonsense; it supports: gguf, int8"):
        check_capabilities("cpu", caps, EngineConfig(model=ModelConfig(quantize="nonsense")))
    sharded = EngineConfig(model=ModelConfig(quantize="int8"), parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(BackendCapabilityError, match="cannot be combined with --num-shard 2"):
        check_capabilities("cpu", caps, sharded)


def test_embedding_dequantizes_only_the_looked_up_rows():
    from switchyard.core.layers import Embedding

    table = weight_of("q8_0", 50, 64)
    embedding = Embedding(50, 64, dtype=torch.bfloat16)
    embedding.load("weight", table)
    assert torch.equal(embedding.quantized.data, table.data) and embedding.weight.numel() == 0
    ids = torch.tensor([[3, 49], [0, 3]])
    expected = torch.nn.functional.embedding(ids, table.dequantize(torch.bfloat16))
    torch.testing.assert_close(embedding(ids), expected)


@pytest.mark.parametrize("argv, words", [
    (["generate", "hi", "--quantize", "nonsense"], "does not support --quantize nonsense; it supports: gguf, int8"),
    (["serve", "--model-id", "llama-tiny", "--load-format", "dummy", "--quantize", "gguf", "--port", "1"],
     "--quantize gguf needs a GGUF model file"),
    (["generate", "hi", "--quantize", "int4", "--num-shard", "2"], "cannot be combined with --num-shard 2"),
])
def test_cli_refuses_in_one_line(capsys, argv, words):
    from switchyard.gateway.cli import main

    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("switchyard: error:")]
    assert len(errors) == 1 and words in errors[0]


def test_auto_activations_take_two_passes_for_small_models_only():
    """"auto" (the default) decides by the whole model's linear weights, the same on every CPU:
    two passes under TWO_PASS_MAX_WEIGHTS (the default 135M model), llama.cpp's one pass above (a
    1.7B); a named setting is kept whatever the size."""
    from switchyard.backends.cpu.quant import TWO_PASS_MAX_WEIGHTS, linear_weights, resolve_activations

    assert resolve_activations("auto", 134_515_008) == "int8x2"
    assert resolve_activations("auto", 1_711_376_384) == "int8"
    assert resolve_activations("auto", TWO_PASS_MAX_WEIGHTS) == "int8"
    assert resolve_activations("int8x2", 10**10) == "int8x2" and resolve_activations("int8", 1) == "int8"
    model = torch.nn.Sequential(Linear(64, 32), torch.nn.ReLU(), Linear(32, 16))
    assert linear_weights(model) == 64 * 32 + 32 * 16
    assert linear_weights(model, shards=3) == 3 * (64 * 32 + 32 * 16)  # each shard holds its slice
