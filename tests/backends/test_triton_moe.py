"""The Triton mixture-of-experts kernel (backends/cuda/kernels/moe.py) against the
plain-torch reference (core/layers/fused_moe.py), and its wiring into the CUDA
backend's layer fusion. Without a GPU it runs under Triton's interpreter, so shapes
stay small."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triton_interpreter import DEVICE, RUNS_HERE, rerun_in_fresh_process, skip_unless_runnable  # noqa: E402  (first: sets TRITON_INTERPRET)

from switchyard.core.layers.fused_moe import FusedMoE, fused_experts, select_experts  # noqa: E402


@pytest.fixture(autouse=True)
def _needs_working_kernels(request):
    skip_unless_runnable(request)


import switchyard.backends.cuda.kernels as kernels  # noqa: E402
from switchyard.backends.cuda.fusion import fuse_layers  # noqa: E402


def _problem(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) / inter ** 0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=generator), top_k, True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def test_align_groups_pairs_by_expert_in_padded_runs():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]], device=DEVICE)
    sorted_pairs, block_experts = kernels.moe_align_block_size(ids, 4, num_experts=5)
    sentinel = ids.numel()
    runs = sorted_pairs.view(-1, 4).tolist()
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5, 7; expert 3: pairs 3, 6; experts 1, 4: none
    assert runs[:3] == [[1, 4, sentinel, sentinel], [0, 2, 5, 7], [3, 6, sentinel, sentinel]]
    assert all(pair == sentinel for run in runs[3:] for pair in run)
    assert block_experts.tolist()[:3] == [0, 2, 3] and set(block_experts.tolist()[3:]) == {5}
    assert sorted_pairs.numel() == 8 + 5 * 3 + 1  # worst case, rounded up to the block


@pytest.mark.parametrize("dtype,num_tokens,top_k,hidden,inter", [
    (torch.float32, 5, 2, 32, 16),  # decode-sized: 16-row runs
    (torch.bfloat16, 3, 3, 32, 16),
    (torch.float32, 40, 2, 80, 48),  # prefill-sized: 64-row runs, two output tiles, a masked second K tile
])
def test_fused_experts_match_the_reference(dtype, num_tokens, top_k, hidden, inter):
    x, w13, w2, weights, ids = _problem(num_tokens, 4, top_k, hidden, inter, dtype, seed=num_tokens)
    got = kernels.fused_experts(x, w13, w2, weights, ids)
    expected = fused_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.cpu(), expected, **tolerance)


def test_cuda_fusion_points_moe_layers_at_the_kernel():
    model = torch.nn.Sequential(FusedMoE(4, 2, 8, 8, renormalize=True), FusedMoE(4, 2, 8, 8, renormalize=False))
    namespace = SimpleNamespace(rms_norm=None, silu_and_mul=None, apply_rotary=None,
                                fused_experts=kernels.fused_experts)
    assert fuse_layers(model, namespace) == {"moe": 2}
    assert all(layer.experts_impl is kernels.fused_experts for layer in model)
    assert fuse_layers(model, namespace) == {}  # already fused: left alone


def test_in_a_fresh_process_if_triton_was_imported_too_early():
    if RUNS_HERE:
        return
    rerun_in_fresh_process(__file__)
