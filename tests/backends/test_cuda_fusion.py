"""Pointing a model's RMSNorm, SiLU-and-mul and rotary at fused kernels (faked here with
plain torch that counts its calls): every layer is swapped and the outputs stay the same."""
from __future__ import annotations

import types
from collections import Counter

import torch
import torch.nn.functional as F

from cuda_fakes import CpuCudaBackend
from switchyard.backends.cuda.fusion import fuse_layers
from switchyard.core.config import ModelConfig
from switchyard.core.layers import apply_rotary
from switchyard.core.loader import load_model
from switchyard.core.execution.runner import build_step_input
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput


def counting_kernels(calls: Counter):
    def rms_norm(x, weight, eps):
        calls["rms_norm"] += 1
        assert x.dim() == 2
        return (weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))

    def silu_and_mul(x):
        calls["silu_and_mul"] += 1
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(x, cos, sin):
        calls["rotary"] += 1
        return apply_rotary(x, cos, sin)

    return types.SimpleNamespace(rms_norm=rms_norm, silu_and_mul=silu_and_mul, apply_rotary=rotary)


def test_every_norm_activation_and_rotary_runs_fused_with_the_same_result():
    loaded = load_model(ModelConfig(model="llama-tiny", load_format="dummy", seed=1), CpuCudaBackend(), 4)
    backend = CpuCudaBackend()
    kv_caches = backend.allocate_kv_cache(loaded.num_layers, 8, loaded.attention_spec)
    step = build_step_input(SchedulerOutput((ScheduledRequest("a", (3, 5, 7, 9, 11), 0, (1, 2), True),)), 4,
                            torch.device("cpu"))

    def logits():
        with torch.inference_mode():
            return loaded.model.compute_logits(loaded.model(step.input_ids, step.positions, kv_caches, step.meta))

    before = logits()
    calls = Counter()
    fused = fuse_layers(loaded.model, counting_kernels(calls))
    assert fused == {"rms_norm": 5, "silu_and_mul": 2, "rotary": 2}  # 2 per layer + the final norm; per layer
    after = logits()
    assert calls == Counter(rms_norm=5, silu_and_mul=2, rotary=2)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
