"""The ROCm backend: its probe on a (faked) HIP build of torch, and what it shares with CUDA."""
from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from switchyard.backends.cuda import CudaBackend
from switchyard.backends.cuda import backend as cuda_backend_module
from switchyard.backends.rocm import FEATURE_DIFFERENCES, RocmBackend, probe_rocm
from switchyard.core.backend import AttentionSpec


def test_probe_here_says_torch_is_not_a_rocm_build():
    result = RocmBackend.probe()
    assert not result.usable and "not a ROCm build" in result.reason


@pytest.fixture
def hip_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec",  # triton installed or not, the probe sees it
                        lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))


def test_probe_on_a_hip_build(hip_torch, monkeypatch):
    assert probe_rocm().usable and probe_rocm().reason == f"8 ROCm devices visible (torch {torch.__version__}, HIP 6.2.41133)"
    assert "the rocm backend serves it" in CudaBackend.probe().reason  # and CUDA steps aside
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert probe_rocm().reason.startswith("no ROCm device visible") and "HIP_VISIBLE_DEVICES=''" in probe_rocm().reason


def test_rocm_reuses_the_cuda_backend_and_says_what_differs(monkeypatch):
    assert issubclass(RocmBackend, CudaBackend) and RocmBackend.priority < CudaBackend.priority
    caps = RocmBackend().capabilities()
    assert caps.graph_mode and caps.attention_impl.startswith("triton paged attention on HIP")
    topics = " ".join(FEATURE_DIFFERENCES)
    assert all(word in topics for word in ("flash-attn", "graphs", "RCCL", "HIP_VISIBLE_DEVICES", "bf16"))
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, block_size=256, scale=0.3, dtype=torch.bfloat16)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.7.4",
                                                                         flash_attn_varlen_func=print))
    monkeypatch.setattr(cuda_backend_module, "triton_attention", lambda s: ("triton", s))
    assert CudaBackend().attention(spec).__class__.__name__ == "FlashAttnKernel"
    assert RocmBackend().attention(spec) == ("triton", spec)  # never flash-attn on ROCm, even where it fits
