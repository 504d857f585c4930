"""Where a decode step's wall time goes outside the model's forward, phase by phase.

    python benchmarks/host_overhead.py [--concurrency 1 32] [--steps 64]
        [--model llama-tiny --load-format dummy] [--dtype bfloat16] [--logprobs N] [--temperature T]
        [--layers N] [--threads N]

An EngineCore runs in this process (no HTTP) with `--concurrency` requests of random
prompts, each generating until `--steps` decode-only steps were timed. Each phase of a
step is timed by wrapping the callable that does it:

    schedule     Scheduler.schedule
    step_input   runner.build_step_input (the StepInput tensors)
    forward      the rest of ModelRunner.execute: model + logits (not host time)
    sample       Sampler.__call__ (processors, argmax / sampling, logprobs)
    update       Scheduler.update (append tokens, stop checks, free blocks)
    engine_rest  the rest of EngineCore.step (sample rows, grammar mask, outputs)
    detokenize   OutputProcessor.process (incremental detokenizer, stop strings)
    message      pickle.dumps + pickle.loads of the step's StepDone (the engine pipe)
    sse          the OpenAI chat chunk of every output rendered as an SSE event

The table gives the median milliseconds per step of each phase, and `host` their sum
without `forward`. The default model is the real one (its tokenizer and 49152-token
vocabulary matter to sampling and detokenizing); `--model llama-tiny --load-format
dummy` makes the forward negligible, and `--layers 1` makes it cheap with the real
vocabulary. To compare two versions, run them alternately (A, B, A, B; e.g. the other
version's core/, gateway/ and backends/ unpacked under DIR/switchyard/ and run with
PYTHONPATH=DIR) and take the smaller figure of each: on a shared machine the figures
of separate runs are not comparable.
"""
from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from collections import defaultdict

import torch

import switchyard.core.execution.runner as runner_module
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.engine.messages import EngineLoad, StepDone, StepStats
from switchyard.core.engine.output_processor import OutputProcessor
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request

PHASES = ("schedule", "step_input", "forward", "sample", "update", "engine_rest", "detokenize", "message", "sse")


class PhaseTimer:
    """Accumulates seconds per phase within one step; `wrap` times a callable as a phase."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start
        return timed

    def take(self) -> dict[str, float]:
        taken, self.current = dict(self.current), defaultdict(float)
        return taken


def instrument(engine: EngineCore, timer: PhaseTimer) -> None:
    """Wraps the engine's phases: its instance attributes, and the runner module's
    build_step_input (once per process: every engine's runner calls that global)."""
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timer.wrap("update", engine.scheduler.update)
    engine.sampler = timer.wrap("sample", engine.sampler)
    engine.runner.execute = timer.wrap("execute", engine.runner.execute)
    runner_module.build_step_input = timer.wrap("step_input", _BUILD_STEP_INPUT)


def sse_renderer():
    """Renders one output as the OpenAI chat chunk the gateway streams (gateway/openai)."""
    from switchyard.gateway.streaming import sse_data

    def render(out) -> str:
        return sse_data({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                         "choices": [{"index": 0, "delta": {"content": out.new_text},
                                      "logprobs": None, "finish_reason": None}]})
    return render


def run(engine: EngineCore, timer: PhaseTimer, tokenizer, args, concurrency: int, rng: random.Random
        ) -> dict[str, float]:
    """Median ms per decode-only step of each phase."""
    processor = OutputProcessor(tokenizer, engine.finish_request)
    render = sse_renderer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 4, ignore_eos=True,
                            logprobs=args.logprobs, seed=None)
    vocab = engine.loaded.vocab_size
    for i in range(concurrency):
        request = Request(f"r{rng.random()}-{i}", [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)],
                          params)
        engine.add_request(request)
        processor.add_request(request)
    load = EngineLoad(concurrency, 0, 0, 0)
    samples: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        step_s = time.perf_counter() - start
        outputs = timer.wrap("detokenize", processor.process)(outputs)
        message = StepDone(tuple(outputs), load, StepStats(load, len(outputs), 0, len(outputs), step_s))
        timer.wrap("message", lambda: pickle.loads(pickle.dumps(message)))()
        timer.wrap("sse", lambda: [render(out) for out in outputs])()
        phases = timer.take()
        scheduled = engine.last_scheduler_output.scheduled
        if len(scheduled) == concurrency and all(s.num_new_tokens == 1 for s in scheduled):
            phases["forward"] = phases.pop("execute") - phases["step_input"]
            phases["engine_rest"] = step_s - sum(phases[p] for p in ("schedule", "step_input", "forward",
                                                                       "sample", "update"))
            samples.append(phases)
    return {p: statistics.median(s.get(p, 0.0) for s in samples) * 1e3 for p in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only the first N decoder layers (a cheaper forward, same vocabulary)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    from switchyard.core.loader import load_tokenizer

    model = ModelConfig(model=args.model, load_format=args.load_format, dtype=args.dtype)
    config = EngineConfig(model=model, cache=CacheConfig(num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192))
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(model)
    rng = random.Random(0)
    print(f"threads={torch.get_num_threads()} model={args.model or 'default'} dtype={args.dtype} "
          f"temperature={args.temperature} logprobs={args.logprobs}  (median ms per decode step)")
    print(f"{'c':>4} " + " ".join(f"{p:>11}" for p in PHASES) + f" {'host':>8}")
    for concurrency in args.concurrency:
        engine, timer = EngineCore(config, tokenizer=tokenizer), PhaseTimer()
        if args.layers:
            keep_layers(engine, args.layers)
        instrument(engine, timer)
        result = run(engine, timer, tokenizer, args, concurrency, rng)
        host = sum(v for p, v in result.items() if p != "forward")
        print(f"{concurrency:>4} " + " ".join(f"{result[p]:>11.3f}" for p in PHASES) + f" {host:>8.3f}")
        engine.shutdown()


def keep_layers(engine: EngineCore, num_layers: int) -> None:
    """Drops the decoder layers past the first `num_layers` (and their KV caches)."""
    model = engine.runner.model.model
    model.layers = model.layers[:num_layers]
    engine.runner.kv_caches = engine.runner.kv_caches[:num_layers]


_BUILD_STEP_INPUT = runner_module.build_step_input

if __name__ == "__main__":
    main()
