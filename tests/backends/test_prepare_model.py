"""Backend.prepare_model is the one place a backend changes the loaded model: the engine
calls it after loading and before profile_run, and neither profile_run nor make_runner
changes the model any more (CPU weight packing, CUDA layer fusion)."""
from __future__ import annotations

import sys
import types
from collections import Counter

import pytest

from cuda_fakes import CpuCudaBackend, make_engine
from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu.linear import PackedLinear, packing_supported
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.layers import Linear, RMSNorm
from switchyard.core.loader import load_model

TINY = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy"), cache=CacheConfig(num_blocks=8))


class RecordingCpu(CpuBackend):
    name = "recording-cpu"

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def init_device(self, shard=None) -> None:
        self.calls.append("init_device")

    def prepare_model(self, loaded, config) -> None:
        self.calls.append("prepare_model")
        super().prepare_model(loaded, config)

    def profile_run(self, loaded, config) -> None:
        self.calls.append("profile_run")

    def allocate_kv_cache(self, num_layers, num_blocks, spec):
        self.calls.append("allocate_kv_cache")
        return super().allocate_kv_cache(num_layers, num_blocks, spec)

    def make_runner(self, loaded, kv_caches, config):
        self.calls.append("make_runner")
        return super().make_runner(loaded, kv_caches, config)


def test_the_engine_calls_the_hooks_in_the_contract_order():
    backend = RecordingCpu()
    EngineCore(TINY, backend=backend).shutdown()
    assert backend.calls == ["init_device", "prepare_model", "profile_run", "allocate_kv_cache", "make_runner"]


def _linears(model) -> Counter:
    return Counter(type(m).__name__ for m in model.modules() if isinstance(m, (Linear, PackedLinear)))


@pytest.mark.skipif(not packing_supported(), reason="this torch has no oneDNN linear packing")
def test_cpu_packs_weights_in_prepare_model_and_make_runner_leaves_the_model_alone():
    backend = CpuBackend()
    loaded = load_model(TINY.model, backend, 16)
    kv_caches = backend.allocate_kv_cache(loaded.num_layers, 8, loaded.attention_spec)
    backend.make_runner(loaded, kv_caches, TINY)
    assert "PackedLinear" not in _linears(loaded.model)
    backend.prepare_model(loaded, TINY)
    assert _linears(loaded.model)["PackedLinear"] > 0 and _linears(loaded.model)["Linear"] == 0
    unpacked = load_model(TINY.model, CpuBackend(pack_weights=False), 16)
    CpuBackend(pack_weights=False).prepare_model(unpacked, TINY)  # still measures single-row products
    assert all(m.single_row_matvec is not None for m in unpacked.model.modules() if isinstance(m, Linear))


def _fused_norms(model) -> int:
    return sum(1 for m in model.modules() if isinstance(m, RMSNorm) and "forward" in vars(m))


def test_cuda_fuses_layers_in_prepare_model_and_profile_run_only_measures(monkeypatch):
    calls = Counter()
    fake = types.SimpleNamespace(rms_norm=lambda x, w, eps: calls.update(["rms_norm"]) or x,
                                 silu_and_mul=lambda x: x, apply_rotary=lambda x, cos, sin: x, fused_experts=None)
    import switchyard.backends.cuda as cuda_package

    monkeypatch.setattr(cuda_package, "kernels", fake, raising=False)  # what `from . import kernels` finds
    monkeypatch.setitem(sys.modules, "switchyard.backends.cuda.kernels", fake)
    backend = CpuCudaBackend()
    engine = make_engine(backend)  # fused_layers=False in the fake: nothing swapped
    assert _fused_norms(engine.loaded.model) == 0 and backend.fused == {}
    backend.profile_run(engine.loaded, engine.config)
    assert _fused_norms(engine.loaded.model) == 0  # measuring changed nothing
    backend.fused_layers = True
    backend.prepare_model(engine.loaded, engine.config)
    assert backend.fused == {"rms_norm": 5, "silu_and_mul": 2, "rotary": 2}
    assert _fused_norms(engine.loaded.model) == 5
