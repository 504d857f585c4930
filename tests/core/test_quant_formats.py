"""Every GGUF block format of core/quant/weight.py against gguf-py's own dequantization: random
blocks, weights quantized by gguf-py, and real matrices of the Gemma 3 270M Q4_K_M file; then
the affine form's invariants, row selection, and the refused shapes.

Exactness: d * u + c equals gguf-py's value for every weight (every d * u is exact in float32,
so both round once, the same way); the bits agree too except for the sign of a zero (gguf-py's
d * (q - 8) is -0.0 where d < 0 and q = 8, our d * 8 + -8d is +0.0), hence `_same`."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from switchyard.core.quant.weight import (BLOCK, BLOCK_BYTES, BLOCK_WEIGHTS, FORMATS, AffineBlocks, QuantizedWeight,
                                          affine_blocks, dequantize_rows)
from switchyard.core.testing.quant_blocks import BLOCK_FORMATS, FP16_FIELDS, random_blocks

EXPECTED = {"q4_0": (32, 4), "q4_1": (32, 4), "q5_0": (32, 5), "q5_1": (32, 5), "q8_0": (32, 8),
            "q4_k": (32, 4), "q5_k": (32, 5), "q6_k": (16, 6)}  # (group, bits)


def _qtype(fmt: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[fmt.upper()]


def _reference(data, fmt: str) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(np.asarray(dequantize(np.asarray(data), _qtype(fmt)), dtype=np.float32))


def _same(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Bit for bit, the sign of zeros aside (x + 0.0 turns -0.0 into +0.0 and nothing else)."""
    return ours.shape == ref.shape and torch.equal((ours + 0.0).view(torch.int32), (ref + 0.0).view(torch.int32))


def test_the_format_tables_agree_with_gguf():
    from gguf.constants import GGML_QUANT_SIZES

    assert set(BLOCK_FORMATS) == set(BLOCK_BYTES) == set(BLOCK_WEIGHTS) and FORMATS[-1] == "int8" and BLOCK == 32
    for fmt in BLOCK_FORMATS:
        assert GGML_QUANT_SIZES[_qtype(fmt)] == (BLOCK_WEIGHTS[fmt], BLOCK_BYTES[fmt])


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_random_blocks_match_gguf_py(fmt):
    weight = random_blocks(fmt, 9, 4, seed=len(fmt) + BLOCK_BYTES[fmt])
    assert _same(weight.dequantize(), _reference(weight.data.numpy(), fmt))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_weights_quantized_by_gguf_py_match(fmt):
    from gguf.quants import quantize

    floats = np.random.default_rng(1).standard_normal((12, 160)).astype(np.float32)
    floats[3] = 0  # an all-zero row: d = 0
    data = quantize(floats, _qtype(fmt))
    weight = QuantizedWeight(fmt, floats.shape, torch.from_numpy(data))
    ours = weight.dequantize()
    assert _same(ours, _reference(data, fmt))
    assert (ours - torch.from_numpy(floats)).abs().max() < 0.5  # it is the weight, roughly


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_affine_blocks_invariants(fmt):
    weight = random_blocks(fmt, 5, 2, seed=3)
    blocks = affine_blocks(weight)
    group, bits = EXPECTED[fmt]
    out, inp = weight.shape
    assert isinstance(blocks, AffineBlocks) and (blocks.group, blocks.bits) == (group, bits)
    assert blocks.d.dtype == blocks.c.dtype == torch.float32 and blocks.u.dtype == torch.uint8
    assert blocks.d.shape == blocks.c.shape == (out, inp // group)
    assert blocks.u.shape == (out, inp // group, group)
    assert int(blocks.u.max()) < 2 ** bits
    if bits < 8:  # random bytes reach every value
        assert int(blocks.u.max()) == 2 ** bits - 1
    w = blocks.d[..., None] * blocks.u.float() + blocks.c[..., None]
    assert torch.equal(w.reshape(out, inp), weight.dequantize())


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_rows_and_dequantize_rows_select_whole_rows(fmt):
    weight = random_blocks(fmt, 8, 2, seed=4)
    full = weight.dequantize()
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weight.rows(perm).dequantize(), full[perm])
    ids = torch.tensor([5, 0, 5, 7])
    assert torch.equal(dequantize_rows(weight, ids), full[ids])


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_wrong_shapes_are_refused(fmt):
    weights, nbytes = BLOCK_WEIGHTS[fmt], BLOCK_BYTES[fmt]
    good = torch.zeros(4, 2 * nbytes, dtype=torch.uint8)
    QuantizedWeight(fmt, (4, 2 * weights), good)
    with pytest.raises(ValueError):
        QuantizedWeight(fmt, (4, 2 * weights), good[:, :-1])  # a byte short
    with pytest.raises(ValueError):
        QuantizedWeight(fmt, (4, 3 * weights), good)  # bytes of 2 blocks for 3
    with pytest.raises(ValueError):
        QuantizedWeight(fmt, (4, 2 * weights), good.view(torch.int8))
    if weights == 256:  # 32-weight blocks' byte count, but `in` not a multiple of 256
        with pytest.raises(ValueError):
            QuantizedWeight(fmt, (4, 2 * weights + 32), torch.zeros(4, 2 * nbytes + nbytes // 8, dtype=torch.uint8))


def test_int8_is_no_block_format():
    weight = QuantizedWeight("int8", (2, 4), torch.zeros(2, 4, dtype=torch.int8), torch.ones(2))
    with pytest.raises(ValueError):
        affine_blocks(weight)


@pytest.fixture(scope="module")
def gemma_tensors(gemma3_gguf_path):
    """The Gemma 3 270M Q4_K_M file's 2-D tensors by ggml type name: {type: [tensor, ...]}."""
    from gguf import GGUFReader

    tensors: dict[str, list] = {}
    for tensor in GGUFReader(gemma3_gguf_path).tensors:
        if len(tensor.shape) == 2:
            tensors.setdefault(tensor.tensor_type.name, []).append(tensor)
    return tensors


def _file_weight(tensor) -> QuantizedWeight:
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # ggml lists the contiguous dim first
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True)).reshape(rows, -1)
    return QuantizedWeight(tensor.tensor_type.name.lower(), (rows, cols), data)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_gemma3_matrices_match_gguf_py(gemma_tensors, kind):
    matrices = [t for t in gemma_tensors[kind] if t.name != "token_embd.weight"][:2]
    assert matrices
    for tensor in matrices:
        weight = _file_weight(tensor)
        assert _same(weight.dequantize(), _reference(tensor.data, kind.lower())), tensor.name


def test_gemma3_embedding_rows_match_gguf_py(gemma_tensors):
    """The tied Q8_0 embedding (262144 rows): only looked-up rows, as the embedding does."""
    (tensor,) = [t for t in gemma_tensors["Q8_0"] if t.name == "token_embd.weight"]
    ids = torch.tensor([0, 2, 106, 262143, 2])
    rows = np.asarray(tensor.data)[ids.numpy()]
    weight = QuantizedWeight("q8_0", (int(tensor.shape[1]), int(tensor.shape[0])),
                             torch.from_numpy(np.array(tensor.data, dtype=np.uint8)))  # a copy: the memmap is read-only
    assert _same(dequantize_rows(weight, ids), _reference(rows, "q8_0"))
