"""The default model (SmolLM2-135M) served through TpuBackend on PJRT's CPU device: greedy
tokens equal to the CPU backend's in float32."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla")

from xla_helpers import compiles, generate  # noqa: E402

from switchyard.backends.cpu import CpuBackend  # noqa: E402
from switchyard.backends.tpu import TpuBackend  # noqa: E402
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from switchyard.core.engine.core import EngineCore  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.slow
def test_default_model_greedy_equals_cpu_backend(default_tokenizer, capsys):
    # the GGUF dequantized on both (the CPU would otherwise multiply its own blocks)
    config = EngineConfig(model=ModelConfig(dtype="float32", max_model_len=96, quantize="none"),
                          cache=CacheConfig(block_size=16, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16))
    prompts = [default_tokenizer.encode(p) for p in PROMPTS]
    backend = TpuBackend()
    xla = EngineCore(config, backend=backend)
    warmed = compiles()
    try:
        got = generate(xla, prompts, 8)
    finally:
        xla.shutdown()
    assert compiles() == warmed
    cpu = EngineCore(config, backend=CpuBackend())
    try:
        assert got == generate(cpu, prompts, 8)
    finally:
        cpu.shutdown()
    with capsys.disabled():
        print(f"\n[xla] default model: {backend.compiled_shapes} shapes compiled in {backend.warm_up_seconds:.1f} s")
