"""Decode step time of the default model: gather path vs in-place kernel, or eager vs compiled.

    python benchmarks/cpu_decode_step.py [--concurrency 32] [--prompt-tokens 180]
        [--new-tokens 32] [--dtype float32] [--compare paths|compiled]

For each engine, an EngineCore with the CPU backend takes `--concurrency` requests of
distinct random prompts at once and generates `--new-tokens` greedy tokens each; the
figure is the median time of the steps that only decode (every request running), so
contexts are about `--prompt-tokens` long. `--compare paths` (the default) sets the
gather path (`in_place_decode` off) against the in-place kernel; `--compare compiled`
sets eager steps against decode graphs compiled at warm-up (EngineConfig.compile_decode,
one bucket per concurrency given: `--concurrency 1,8,32`), and prints each bucket's
compile time and whether it came from the compile cache. The engines alternate (A, B,
A, B) so that a noisy neighbour disturbs both alike. Run it alone: a second torch
process on a 2-core machine slows everything several-fold.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace

import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.core.config import EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request


def decode_step_ms(engine: EngineCore, concurrency: int, args, rng: random.Random) -> float:
    """Median milliseconds of the steps in which all requests decode."""
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for i in range(concurrency):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        engine.add_request(Request(f"r{rng.random()}-{i}", prompt, params))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        scheduled = engine.last_scheduler_output.scheduled if engine.last_scheduler_output else ()
        if len(scheduled) == concurrency and all(s.num_new_tokens == 1 for s in scheduled):
            times.append(elapsed)
        del outputs
    return statistics.median(times) * 1e3


def make_engines(args, concurrencies: list[int]) -> dict[str, EngineCore]:
    config = EngineConfig(model=ModelConfig(dtype=args.dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max(concurrencies), max_num_batched_tokens=8192))
    if args.compare == "paths":
        return {"gather": EngineCore(config, backend=CpuBackend(in_place_decode=False)),
                "in place": EngineCore(config, backend=CpuBackend())}
    began = time.perf_counter()
    compiled = EngineCore(replace(config, compile_decode=True, graph_batch_sizes=tuple(concurrencies)),
                          backend=CpuBackend(fused_decode=False))
    runner = compiled.runner
    print(f"compiled engine built in {time.perf_counter() - began:.1f} s; buckets "
          + ", ".join(f"{b}: {s:.1f} s" for b, s in runner.compile_seconds.items())
          + f"; {runner.cache_hits} graph(s) from the cache {runner.options.cache_dir}"
          + (f"; OFF: {runner.disabled_reason}" if runner.disabled_reason else ""))
    return {"eager": EngineCore(config, backend=CpuBackend()), "compiled": compiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="32", help="one or more, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=180)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compare", default="paths", choices=["paths", "compiled"])
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engines = make_engines(args, concurrencies)
    (base, base_engine), (other, _) = engines.items()
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} context~{args.prompt_tokens}+{args.new_tokens}")
    print(base_engine.backend.attention_impl())
    rng = random.Random(0)
    for concurrency in concurrencies:
        results = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                results[name].append(decode_step_ms(engine, concurrency, args, rng))
        for name, figures in results.items():
            print(f"c={concurrency:<3} {name:>9}: decode step {min(figures):.1f} ms "
                  f"(rounds: {', '.join(f'{f:.1f}' for f in figures)})")
        print(f"c={concurrency:<3} {other} / {base}: {min(results[other]) / min(results[base]):.2f}")


if __name__ == "__main__":
    main()
