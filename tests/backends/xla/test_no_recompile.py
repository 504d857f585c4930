"""Static shapes: after warm-up, a varied workload compiles nothing (torch_xla's metrics)."""
from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla")

from xla_helpers import compiles, generate, tiny_config  # noqa: E402

from switchyard.backends.cpu import CpuBackend  # noqa: E402
from switchyard.backends.tpu import TpuBackend  # noqa: E402
from switchyard.core.engine.core import EngineCore  # noqa: E402


def test_warm_up_compiles_each_bucket_once_and_serving_compiles_nothing(capsys):
    backend = TpuBackend()
    before = compiles()
    engine = EngineCore(tiny_config(), backend=backend)
    shapes = engine.runner.buckets.shapes()
    assert backend.compiled_shapes == len(shapes) == 6  # tokens (16, 32) x requests (1, 2, 4)
    warmed = compiles()
    assert 0 < warmed - before <= len(shapes) + 2  # one graph per shape (+ the cache/weight transfers)
    rng = random.Random(0)
    shared = [rng.randrange(1, 200) for _ in range(20)]
    workloads = [  # (prompts, max_tokens): batch sizes 1..6, short and chunked prompts, shared prefixes
        ([[rng.randrange(1, 200) for _ in range(5)]], 6),
        ([[rng.randrange(1, 200) for _ in range(n)] for n in (3, 17, 40)], 5),
        ([shared + [i] for i in range(4)], 4),
        ([[rng.randrange(1, 200) for _ in range(n)] for n in (2, 9, 1, 30, 12, 7)], 7),
    ]
    try:
        for i, (prompts, max_tokens) in enumerate(workloads):
            got = generate(engine, prompts, max_tokens, prefix=f"w{i}-")
            assert all(len(tokens) == max_tokens for tokens in got.values())
    finally:
        engine.shutdown()
    assert compiles() == warmed, "a step compiled a new graph after warm-up"
    with capsys.disabled():
        print(f"\n[xla] {backend.compiled_shapes} bucket shapes compiled at warm-up in {backend.warm_up_seconds:.1f} s")


def test_tiny_model_greedy_output_equals_the_cpu_backend_across_buckets():
    prompts = [[5, 9, 13], list(range(40, 75)), [7, 3, 2, 8, 1], [11] * 20, [100, 101]]
    config = tiny_config()
    xla = EngineCore(config, backend=TpuBackend())
    cpu = EngineCore(config, backend=CpuBackend(pack_weights=False))
    try:
        assert generate(xla, prompts, 6) == generate(cpu, prompts, 6)
    finally:
        xla.shutdown()
        cpu.shutdown()
