"""Decode step time of the default model at one concurrency, gather path vs in-place kernel.

    python benchmarks/cpu_decode_step.py [--concurrency 32] [--prompt-tokens 180]
        [--new-tokens 32] [--dtype float32]

For each path, an EngineCore with the CPU backend (`in_place_decode` on or off) takes
`--concurrency` requests of distinct random prompts at once and generates
`--new-tokens` greedy tokens each; the figure is the median time of the steps that
only decode (every request running), so contexts are about `--prompt-tokens` long.
The paths alternate (gather, in place, gather, in place) so that a noisy neighbour
disturbs both alike. Run it alone: a second torch process on a 2-core machine slows
everything several-fold.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from switchyard.backends.cpu import CpuBackend
from switchyard.core.config import EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.request import Request


def decode_step_ms(engine: EngineCore, args, rng: random.Random) -> float:
    """Median milliseconds of the steps in which all requests decode."""
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for i in range(args.concurrency):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        engine.add_request(Request(f"r{rng.random()}-{i}", prompt, params))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        scheduled = engine.last_scheduler_output.scheduled if engine.last_scheduler_output else ()
        if len(scheduled) == args.concurrency and all(s.num_new_tokens == 1 for s in scheduled):
            times.append(elapsed)
        del outputs
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=180)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = EngineConfig(model=ModelConfig(dtype=args.dtype),
                          scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=8192))
    engines = {"gather": EngineCore(config, backend=CpuBackend(in_place_decode=False)),
               "in place": EngineCore(config, backend=CpuBackend())}
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} concurrency={args.concurrency} "
          f"context~{args.prompt_tokens}+{args.new_tokens}")
    print(engines["in place"].backend.attention_impl())
    rng, results = random.Random(0), {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            results[name].append(decode_step_ms(engine, args, rng))
    for name, figures in results.items():
        print(f"{name:>9}: decode step {min(figures):.1f} ms (rounds: {', '.join(f'{f:.1f}' for f in figures)})")
    print(f"in place / gather: {min(results['in place']) / min(results['gather']):.2f}")


if __name__ == "__main__":
    main()
