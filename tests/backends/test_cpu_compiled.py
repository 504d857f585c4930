"""The CPU backend's compiled decode steps (backends/cpu/compiled.py) against its eager path:
the same greedy tokens, close logits, padding rows that write no KV, eager prompt and mixed
steps, the compile cache reused by a second start, and eager with a logged reason when
compilation fails. One engine compiles per dtype (a few seconds of inductor each)."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu import compiled as compiled_module
from switchyard.backends.cpu.compiled import CompiledDecodeRunner, compile_sizes
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.execution.runner import ModelRunner
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput

PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]
MAX_TOKENS = [9, 7, 5, 3]  # the batch shrinks 4 -> 3 (padded to 4) -> 2 -> 1 (padded to 2)


def make_engine(cache_root, dtype="float32", compile_decode=True, sizes=(2, 4), backend=None, kv_cache_dtype="auto"):
    config = EngineConfig(
        model=ModelConfig(model="llama-tiny", load_format="dummy", seed=3, max_model_len=96, dtype=dtype,
                          cache_dir=str(cache_root)),
        cache=CacheConfig(block_size=4, num_blocks=64, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        compile_decode=compile_decode, graph_batch_sizes=sizes)
    return EngineCore(config, backend=backend or CpuBackend(fused_decode=False))


def generate(engine, decode_sizes: list | None = None):
    """Greedy tokens per request; appends the size of every decode-only step to decode_sizes."""
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(Request(f"r{i}", list(prompt), params))
    out = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        scheduled = engine.last_scheduler_output.scheduled
        if decode_sizes is not None and all(s.num_new_tokens == 1 for s in scheduled):
            decode_sizes.append(len(scheduled))
    return out


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("switchyard-cache")


@pytest.fixture(scope="module")
def eager(cache_root):
    engine = make_engine(cache_root, compile_decode=False)
    return engine, generate(engine)


@pytest.fixture(scope="module")
def compiled(cache_root):
    engine, decode_sizes = make_engine(cache_root), []
    return engine, generate(engine, decode_sizes), decode_sizes


def decode_step(num: int, samples=lambda i: True) -> SchedulerOutput:
    """num decodes at positions 5.. of requests holding blocks (2i + 3, 2i + 4)."""
    return SchedulerOutput(tuple(ScheduledRequest(f"d{i}", (7 + i,), 5 + i, (3 + 2 * i, 4 + 2 * i), samples(i))
                                 for i in range(num)))


def test_buckets_come_from_the_configuration_or_the_defaults_within_max_num_seqs():
    assert compile_sizes(256, None) == (1,)  # see DEFAULT_SIZES: padding loses to eager on a CPU
    assert compile_sizes(256, (8, 1, 4, 1000, 0)) == (1, 4, 8)
    assert compile_sizes(256, ()) == ()


def test_compiled_decode_steps_give_the_eager_tokens(eager, compiled):
    engine, tokens, decode_sizes = compiled
    runner = engine.runner
    assert isinstance(runner, CompiledDecodeRunner) and runner.disabled_reason is None
    assert runner.compiled_sizes == (2, 4) and set(runner.compile_seconds) == {2, 4}
    assert tokens == eager[1]
    # decode steps of 4 and 3 requests ran bucket 4, those of 2 and 1 bucket 2; the prompt step ran eager
    assert sorted(set(decode_sizes)) == [1, 2, 3, 4] and runner.num_compiled_steps == len(decode_sizes)


def test_compiled_decode_steps_over_a_quantized_kv_cache_give_the_eager_tokens(cache_root):
    """--kv-cache-dtype int8 through the graphs' opaque ops: write_kv quantizes (padding rows write
    nothing), paged_decode reads the codes, as the eager steps do."""
    eager = make_engine(cache_root, compile_decode=False, kv_cache_dtype="int8")
    engine = make_engine(cache_root, kv_cache_dtype="int8")
    assert isinstance(engine.runner, CompiledDecodeRunner) and engine.runner.disabled_reason is None
    assert generate(engine) == generate(eager) and engine.runner.num_compiled_steps > 0
    assert all(cache.dtype == torch.int8 and not cache[:, 0].any() for cache in engine.runner.kv_caches)


def test_padding_rows_write_no_kv(eager, compiled):
    for kv, reference in zip(compiled[0].runner.kv_caches, eager[0].runner.kv_caches):
        assert torch.count_nonzero(kv[:, 0]) == 0  # the reserved block: where padding rows attend
        torch.testing.assert_close(kv, reference)  # every real request's keys and values as eager wrote them


def test_prompt_mixed_and_oversized_steps_run_eager(compiled):
    runner = compiled[0].runner
    mixed = SchedulerOutput((ScheduledRequest("d", (7,), 5, (3, 4), True),
                             ScheduledRequest("p", (1, 2, 3), 0, (5,), True)))
    scoring = SchedulerOutput((ScheduledRequest("d", (7,), 5, (3, 4), True, computes_prompt_logprobs=True),))
    assert runner.graph_batch_size(mixed) is None and runner.graph_batch_size(scoring) is None
    assert runner.graph_batch_size(decode_step(5)) is None  # above the largest bucket
    assert runner.graph_batch_size(decode_step(3)) == 4 and runner.graph_batch_size(decode_step(1)) == 2
    before = runner.num_compiled_steps
    logits, ids = runner.execute(mixed)
    assert ids == ("d", "p") and logits.shape[0] == 2 and runner.num_compiled_steps == before


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_compiled_logits_are_close_to_eager(cache_root, compiled, dtype, tolerance):
    engine = compiled[0] if dtype == "float32" else make_engine(cache_root, dtype, sizes=(4,))
    runner = engine.runner
    step = decode_step(3, samples=lambda i: i != 1)  # padded to 4; d1 does not sample
    logits, ids = runner.execute(step)
    eager_logits, eager_ids = ModelRunner.execute(runner, step)  # the same step (same KV writes), eager
    assert ids == eager_ids == ("d0", "d2") and logits.dtype == torch.float32
    torch.testing.assert_close(logits, eager_logits, atol=tolerance, rtol=tolerance)
    assert logits.argmax(-1).tolist() == eager_logits.argmax(-1).tolist()


def test_a_second_start_reuses_the_compile_cache(cache_root, compiled):
    directory = compiled[0].runner.options.cache_dir
    assert directory == os.path.join(str(cache_root), "inductor")
    before = sorted(os.path.join(d, f) for d, _, files in os.walk(directory) for f in files if f.endswith(".so"))
    assert before  # the compiled kernels are kept there
    again = make_engine(cache_root).runner
    after = sorted(os.path.join(d, f) for d, _, files in os.walk(directory) for f in files if f.endswith(".so"))
    assert again.compiled_sizes == (2, 4) and after == before  # nothing new was built


def test_the_cache_directory_is_set_for_the_compile_only(cache_root, compiled, monkeypatch, tmp_path):
    """Inductor reads its cache location from the environment: the configured one is in effect
    while the buckets compile, and the process's own value is back afterwards."""
    users_own = tmp_path / "users-own"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(users_own))
    seen = []
    real_compile = compiled_module.torch.compile

    def watching_compile(function, **kwargs):
        graph = real_compile(function, **kwargs)

        def run(*args):
            seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
            return graph(*args)
        return run

    monkeypatch.setattr(compiled_module.torch, "compile", watching_compile)
    runner = make_engine(cache_root).runner
    assert runner.compiled_sizes == (2, 4)
    assert set(seen[:2]) == {os.path.join(str(cache_root), "inductor")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(users_own)


def test_a_failed_compilation_runs_eager_and_says_why(cache_root, eager, monkeypatch, caplog):
    def broken_compile(function, **kwargs):
        def run(*args):
            raise RuntimeError("injected compiler failure\nsecond line")
        return run

    monkeypatch.setattr(compiled_module.torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        engine = make_engine(cache_root)
    runner = engine.runner
    assert runner.disabled_reason == "compilation failed (RuntimeError: injected compiler failure)"
    assert runner.compiled_sizes == () and "injected compiler failure" in caplog.text
    assert generate(engine) == eager[1] and runner.num_compiled_steps == 0


def test_without_the_in_place_kernel_nothing_is_compiled(cache_root, caplog):
    with caplog.at_level(logging.INFO, logger=compiled_module.__name__):
        runner = make_engine(cache_root, backend=CpuBackend(in_place_decode=False, fused_decode=False)).runner
    assert runner.disabled_reason == "the in-place decode kernel is switched off" and runner.compiled_sizes == ()
    assert "CPU decode graphs off: the in-place decode kernel is switched off" in caplog.text


def test_the_library_default_is_eager(cache_root):
    from switchyard.backends.cpu.runner import CpuModelRunner

    assert type(make_engine(cache_root, compile_decode=False).runner) is CpuModelRunner
