"""The Triton LoRA shrink and expand of the CUDA/ROCm backend (backends/cuda/kernels/lora.py)
against the plain-torch reference (core/lora/kernel.py). Without a GPU they run under Triton's
interpreter, so shapes stay small."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from triton_interpreter import DEVICE, RUNS_HERE, rerun_in_fresh_process, skip_unless_runnable  # noqa: E402  (first: sets TRITON_INTERPRET)

from switchyard.core.testing.lora_batches import random_lora_step  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float16: dict(atol=4e-3, rtol=4e-3)}
# (tokens, in, out, rank): widths not a power of two, a rank over one shrink tile (16) and one
# over one expand tile (64), a rank of 3
SHAPES = [(12, 72, 40, 16), (7, 300, 90, 24), (5, 40, 70, 80), (6, 24, 17, 3)]


@pytest.fixture(autouse=True)
def _needs_working_kernels(request):
    skip_unless_runnable(request)


from switchyard.backends.cuda.kernels.lora import TritonLoraKernel  # noqa: E402


def _steps(dtype):
    for seed, (tokens, width, out, rank) in enumerate(SHAPES):
        step = random_lora_step(seed, dtype, DEVICE, tokens=tokens, in_features=width, out_features=out, slots=3,
                                rank=rank)
        yield f"{dtype} {tokens}x{width}->{out} rank {rank}", step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shrink_and_expand_match_the_reference(dtype):
    kernel = TritonLoraKernel()
    for case, step in _steps(dtype):
        expected_h, expected = step.reference()
        h, got = step.run(kernel)
        adapted = step.batch.token_slots.cpu() >= 0
        torch.testing.assert_close(h[adapted], expected_h[adapted], **TOLERANCE[dtype], msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype], msg=lambda m: f"{case}: {m}")
        wide = step.wide.cpu()
        assert torch.equal(got[~adapted], wide[~adapted]), f"{case}: tokens of slot -1 changed"
        assert torch.equal(got[:, :step.margin], wide[:, :step.margin]), case
        assert torch.equal(got[:, step.margin + step.out_features:], wide[:, step.margin + step.out_features:]), case


def test_a_token_gets_the_same_bits_alone_as_in_its_batch():
    kernel = TritonLoraKernel()
    for case, step in _steps(torch.float32):
        h, got = step.run(kernel)
        for t in range(step.x.shape[0]):
            alone_h, alone = step.token(t).run(kernel)
            assert torch.equal(alone[0], got[t]), f"{case}: token {t}"
            if step.batch.token_slots[t] >= 0:
                assert torch.equal(alone_h[0], h[t]), f"{case}: token {t}"


def test_steps_without_adapters_or_tokens_and_a_dense_y():
    kernel = TritonLoraKernel()
    for runs in ([], [(4, -1)]):
        step = random_lora_step(3, device=DEVICE, runs=runs)
        h, got = step.run(kernel)
        assert h.shape == (len(step.x), 16) and torch.equal(got, step.wide.cpu())
    step = random_lora_step(4, device=DEVICE, tokens=6)
    y = step.wide.t().contiguous().t()  # column-major: expanded through a contiguous copy
    y0 = y.clone()
    h = kernel.shrink(step.x, step.a, step.batch)
    b = torch.randn(step.a.shape[0], y.shape[1], step.a.shape[1], device=DEVICE)
    kernel.expand(y, h, b, step.scales, step.batch)
    from switchyard.core.lora.kernel import TorchLoraKernel

    TorchLoraKernel().expand(y0, h, b, step.scales, step.batch)
    torch.testing.assert_close(y, y0, **TOLERANCE[torch.float32])


def test_int64_slots_and_stacks_in_another_dtype():
    step = random_lora_step(5, torch.bfloat16, DEVICE)
    step = replace(step, a=step.a.float(), b=step.b.float(),
                   batch=replace(step.batch, token_slots=step.batch.token_slots.long()))
    expected_h, expected = step.reference()
    h, got = step.run(TritonLoraKernel())
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.bfloat16])


def test_the_cuda_and_rocm_backends_declare_it():
    from switchyard.backends.cuda import CudaBackend
    from switchyard.backends.rocm import RocmBackend

    for backend in (CudaBackend(), RocmBackend()):
        assert backend.capabilities().lora
        assert isinstance(backend.lora_kernel(), TritonLoraKernel)


def test_in_a_fresh_process_if_triton_was_imported_too_early():
    if RUNS_HERE:
        return
    rerun_in_fresh_process(__file__)
