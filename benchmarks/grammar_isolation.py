"""Does compiling heavy grammars slow down unconstrained streams? (issue 15)

On the default model through the real engine client: the inter-token latency (ITL) of one
plain greedy stream, alone and while several distinct heavy JSON schemas (~220 KB enums,
seconds each to compile) compile, for

- `process`: this design, compiles in a low-priority worker process (the default), and
- `thread`: the peer, the old design, compiles in a thread of the serving process.

It also times a trivial schema submitted after the heavy ones (its wait in the queue).

    python benchmarks/grammar_isolation.py [--tokens 160] [--heavy 3] [--modes process,thread]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, GrammarConfig, ModelConfig, SchedulerConfig
from switchyard.core.grammar import GrammarError, GrammarSpec
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request


def heavy_schema(seed: int, size: int = 12000) -> GrammarSpec:
    return GrammarSpec.json_schema({"type": "object", "properties": {"pick": {
        "enum": [f"s{seed}-item-{i:06d}-{'x' * (i % 7)}" for i in range(size)]}}, "required": ["pick"]})


def make_client(grammar: GrammarConfig) -> InProcessEngineClient:
    def factory():
        from switchyard.core.engine.core import EngineCore
        from switchyard.core.loader import load_tokenizer

        config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_blocks=512),
                              scheduler=SchedulerConfig(max_num_seqs=8), grammar=grammar)
        tokenizer = load_tokenizer(config.model)
        return EngineCore(config, tokenizer=tokenizer), tokenizer

    return InProcessEngineClient(factory)


async def stream_itl(client, prompt_ids: list[int], tokens: int, rid: str) -> list[float]:
    """Seconds between consecutive tokens of one plain greedy stream (first token excluded)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stamps = []
    async for out in await client.add_request(Request(rid, prompt_ids, params)):
        stamps.extend(time.perf_counter() for _ in out.new_token_ids if out.new_token_ids)
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


async def compile_timed(client, spec: GrammarSpec) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        await client.compile_grammar(spec)
        outcome = "ok"
    except GrammarError as exc:
        outcome = "timeout" if "took longer" in str(exc) else "refused"
    return time.perf_counter() - start, outcome


def summary(itl: list[float]) -> tuple[float, float]:
    ordered = sorted(itl)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


async def run_mode(mode: str, tokens: int, num_heavy: int, rounds: int) -> dict:
    client = make_client(GrammarConfig(use_processes=mode == "process", compile_timeout_s=30.0))
    client.start()
    await client.wait_ready(600)
    ids = client.tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
    await client.compile_grammar(GrammarSpec.regex("(yes|no)"))  # the worker is up: not timed below
    await stream_itl(client, ids, 16, "warm")
    alone, loaded, compiles, trivial = [], [], [], []
    for r in range(rounds):
        alone += await stream_itl(client, ids, tokens, f"alone-{r}")
        heavy = [asyncio.create_task(compile_timed(client, heavy_schema(r * num_heavy + i))) for i in range(num_heavy)]
        await asyncio.sleep(0.5)  # the compiles are under way
        small = asyncio.create_task(compile_timed(client, GrammarSpec.json_schema(
            {"type": "object", "properties": {"n": {"type": "integer"}, "r": {"const": r}}})))
        loaded += await stream_itl(client, ids, tokens, f"loaded-{r}")
        trivial.append((await small)[0])
        compiles += await asyncio.gather(*heavy)
    await client.shutdown()
    return {"alone": summary(alone), "loaded": summary(loaded), "trivial_s": max(trivial),
            "heavy_s": statistics.median(t for t, _ in compiles),
            "outcomes": {o: sum(1 for _, x in compiles if x == o) for o in ("ok", "timeout", "refused")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=160, help="tokens of each plain stream")
    parser.add_argument("--heavy", type=int, default=3, help="distinct heavy schemas compiling at once")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="process,thread")
    args = parser.parse_args()
    print(f"plain stream of {args.tokens} tokens, alone vs while {args.heavy} heavy schemas compile "
          f"(~{len(heavy_schema(0).value) // 1024} KB each); ITL in ms\n")
    print(f"{'mode':8} {'alone p50':>9} {'p99':>7} {'loaded p50':>10} {'p99':>7} {'p50 x':>6} {'p99 x':>6} "
          f"{'heavy s':>8} {'trivial s':>9}  outcomes")
    for mode in args.modes.split(","):
        r = asyncio.run(run_mode(mode, args.tokens, args.heavy, args.rounds))
        (a50, a99), (l50, l99) = r["alone"], r["loaded"]
        print(f"{mode:8} {a50:9.1f} {a99:7.1f} {l50:10.1f} {l99:7.1f} {l50 / a50:6.2f} {l99 / a99:6.2f} "
              f"{r['heavy_s']:8.2f} {r['trivial_s']:9.2f}  {r['outcomes']}", flush=True)


if __name__ == "__main__":
    main()
