"""The CPU's batched LoRA kernel (backends/cpu/lora.py, csrc/lora.cpp) against the plain-torch
reference (core/lora/kernel.py): float32 and bfloat16 activations and stacks, ranks padded and not
a multiple of 16, widths not a multiple of 16, runs longer than a task's, y a column slice; every
token's output bit for bit the same alone as in its batch, on one thread or two; every
instruction-set level this CPU runs (kernel_variants.py); the plain-torch fallback."""
from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu import lora as cpu_lora
from switchyard.backends.cpu.lora import LORA_SOURCE, CpuLoraKernel, load_lora_ops
from switchyard.core.backend import LoraBatch
from switchyard.core.config import EngineConfig, LoraConfig
from switchyard.core.loader.gguf_cache import default_cache_root
from switchyard.core.testing.lora_batches import lora_batch, random_lora_step

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (tokens, in, out, rank): a layer of the default model (576 -> 1536), the down projection at rank
# 64, widths and a rank that are not multiples of 16, a rank below the register block, a rank over
# the stack buffers' 64. Runs of 1..40 tokens: expand's two paths (rows below 4 tokens of a slot,
# transposed columns from 4) give a token alone and in its batch the same bits.
SHAPES = [(40, 576, 1536, 16), (37, 1536, 576, 64), (23, 100, 70, 13), (9, 24, 17, 3), (30, 40, 33, 80)]


@pytest.fixture(scope="module")
def lora_ops():
    build = load_lora_ops(default_cache_root())
    if not build.available:
        pytest.skip(f"the LoRA kernel did not build: {build.reason}")
    return build.ops


def _long_runs(seed: int, tokens: int, slots: int) -> list[tuple[int, int]]:
    """Runs of 1..40 tokens (longer than a task's 16: one slot cut into several tasks), -1 among them."""
    rng, runs, total = random.Random(seed), [], 0
    while total < tokens:
        count = min(tokens - total, rng.choice([1, 2, 5, 17, 40]))
        runs.append((count, rng.randrange(-1, slots)))
        total += count
    return runs


def _steps(dtype, weight_dtype=None):
    for seed, (tokens, width, out, rank) in enumerate(SHAPES):
        step = random_lora_step(seed, dtype, tokens=tokens, in_features=width, out_features=out, slots=5, rank=rank,
                                runs=_long_runs(seed, tokens, 5))
        if weight_dtype is not None:
            step = replace(step, a=step.a.to(weight_dtype), b=step.b.to(weight_dtype))
        yield f"{dtype} {tokens}x{width}->{out} rank {rank}", step


def _check_against_reference(kernel, dtype, weight_dtype=None):
    for case, step in _steps(dtype, weight_dtype):
        expected_h, expected = step.reference()
        h, got = step.run(kernel)
        adapted = step.batch.token_slots >= 0
        assert h.dtype == dtype and got.dtype == dtype, case
        torch.testing.assert_close(h[adapted], expected_h[adapted], **TOLERANCE[dtype], msg=lambda m: f"{case}: {m}")
        assert not h[~adapted].any(), f"{case}: rows of slot -1 are zeros"
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype], msg=lambda m: f"{case}: {m}")
        assert torch.equal(got[~adapted], step.wide[~adapted]), case
        inside = slice(step.margin, step.margin + step.out_features)
        assert torch.equal(got[:, :inside.start], step.wide[:, :inside.start]), case
        assert torch.equal(got[:, inside.stop:], step.wide[:, inside.stop:]), case


def _check_batch_invariance(kernel, dtype):
    for case, step in _steps(dtype):
        h, got = step.run(kernel)
        for t in range(step.x.shape[0]):
            alone_h, alone = step.token(t).run(kernel)
            assert torch.equal(alone[0], got[t]), f"{case}: token {t}"
            if step.batch.token_slots[t] >= 0:
                assert torch.equal(alone_h[0], h[t]), f"{case}: token {t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_the_reference(lora_ops, dtype):
    _check_against_reference(CpuLoraKernel(lora_ops), dtype)


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_stacks_in_another_dtype_than_the_activations(lora_ops, dtype, weight_dtype):
    _check_against_reference(CpuLoraKernel(lora_ops), dtype, weight_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_bits_alone_as_in_its_batch(lora_ops, dtype):
    _check_batch_invariance(CpuLoraKernel(lora_ops), dtype)


def test_the_threads_change_no_bit(lora_ops):
    kernel, threads = CpuLoraKernel(lora_ops), torch.get_num_threads()
    for _, step in _steps(torch.float32):
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            try:
                results.append(step.run(kernel))
            finally:
                torch.set_num_threads(threads)
        assert all(torch.equal(x, y) for x, y in zip(*results))


def test_steps_without_adapters_or_tokens(lora_ops):
    kernel = CpuLoraKernel(lora_ops)
    for runs in ([], [(4, -1)], [(2, -1), (3, 1), (1, -1)]):
        step = random_lora_step(3, runs=runs)
        h, got = step.run(kernel)
        expected_h, expected = step.reference()
        assert h.shape == expected_h.shape and torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    # a segment list with an empty run (the kernel reads token_slots, SGMV's runs are a view of it)
    step = random_lora_step(4, runs=[(3, 0), (2, 1)])
    batch = LoraBatch(step.batch.token_slots, ((0, 3, 0), (3, 3, 2), (3, 5, 1)))
    h = kernel.shrink(step.x, step.a, batch)
    assert torch.allclose(h, step.reference()[0], atol=1e-5)


def test_bad_operands_are_refused(lora_ops):
    x, a = torch.randn(3, 32), torch.randn(2, 16, 32)
    with pytest.raises(RuntimeError, match="outside"):
        lora_ops.lora_shrink(x, a, torch.tensor([0, 2, -1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="outside"):
        lora_ops.lora_shrink(x, a, torch.tensor([0, -2, -1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"x \[T, in\]"):
        lora_ops.lora_shrink(x, torch.randn(2, 16, 31), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="float32 scales"):
        lora_ops.lora_expand(torch.zeros(3, 8), torch.zeros(3, 16), torch.zeros(2, 8, 16), torch.ones(3),
                             torch.zeros(3, dtype=torch.int32))


def test_without_the_extension_the_reference_computes_the_deltas():
    kernel = CpuLoraKernel(None, "no C++ compiler ('c++' not found)")
    assert "plain torch (no C++ compiler" in kernel.path
    step = random_lora_step(5)
    assert all(torch.equal(x, y) for x, y in zip(step.run(kernel), step.reference()))


def test_float16_and_strided_columns_go_through_the_reference(lora_ops):
    kernel = CpuLoraKernel(lora_ops)
    step = random_lora_step(6, torch.float16)
    assert all(torch.equal(x, y) for x, y in zip(step.run(kernel), step.reference()))
    step = random_lora_step(7)
    y = step.wide.t().contiguous().t()  # column-major: its columns are strided
    expected = y.clone()
    h = kernel.shrink(step.x, step.a, step.batch)
    kernel.expand(y, h, torch.randn(step.a.shape[0], y.shape[1], step.a.shape[1]), step.scales, step.batch)
    assert not torch.equal(y, expected)


def test_the_backend_declares_it_and_builds_it_at_the_engines_level(monkeypatch):
    backend = CpuBackend(pack_weights=False)
    assert backend.capabilities().lora
    assert isinstance(backend.lora_kernel(), CpuLoraKernel) and backend.lora_kernel() is backend.lora_kernel()
    loads = []
    monkeypatch.setattr(cpu_lora.CpuLoraKernel, "load",
                        classmethod(lambda cls, root, isa: loads.append((root, isa)) or cls(None, "test", isa)))
    loaded = SimpleNamespace(model=nn.Identity(), dtype=torch.float32)
    backend.prepare_model(loaded, EngineConfig(isa="avx2", lora=LoraConfig(enable=True)))
    assert loads == [(default_cache_root(), "avx2")]  # built at warm-up, at the forced level
    assert backend.lora_kernel().isa == "avx2" and len(loads) == 1


def test_the_ops_have_fake_implementations_for_compiled_graphs(lora_ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, a, slots = torch.empty(5, 32), torch.empty(3, 16, 32), torch.empty(5, dtype=torch.int32)
        assert lora_ops.lora_shrink(x, a, slots).shape == (5, 16)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["portable", "avx2", "avx512"])
def test_other_instruction_sets_compute_the_same(variant, tmp_path):
    """The loops an AVX2-only CPU builds (vec16.h's pairs of 8-lane registers), AVX-512 without
    VNNI, and the portable ones: against the reference, and batch invariant."""
    from kernel_variants import build_variant

    ops = build_variant(LORA_SOURCE, variant, tmp_path)
    assert ops.lora_isa() == variant
    for dtype in (torch.float32, torch.bfloat16):
        _check_against_reference(CpuLoraKernel(ops), dtype)
    _check_batch_invariance(CpuLoraKernel(ops), torch.float32)


def test_lora_batch_helper_builds_both_views():
    batch = lora_batch([(2, 1), (1, -1), (3, 0), (0, 2)])
    assert batch.token_slots.tolist() == [1, 1, -1, 0, 0, 0]
    assert batch.segments == ((0, 2, 1), (3, 6, 0))
