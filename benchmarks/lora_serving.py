"""LoRA serving throughput against the base model, through `switchyard serve` as users run it
(issue 41's aim: 32 requests spread over 8 adapters at no less than 0.8x the base model's
throughput at the same concurrency; and the cost of swapping adapters in and out of their slots).

    python benchmarks/lora_serving.py [--adapters 8] [--rank 16] [--requests 32] [--tokens 128]

One server: the default model on its default path, --max-batch-total-tokens 16384, --adapters PEFT
adapters of rank --rank on every projection (made by peft over the model's shapes,
benchmarks/lora_steps.py make_adapter) named at start. Rows, each after 4 warm-up requests:
- base: --requests requests at once, all to the base model;
- adapters: the same, request i to adapter i mod --adapters;
- swapping: a second server with --max-loras 2, the same spread: every step may copy adapters into
  their slots (the LRU), so its ratio to `adapters` is what the swaps cost.
Each request: a short prompt, --tokens output tokens forced (ignore_eos, min_tokens). Prints output
tok/s per row and the ratios. Benchmark only an idle machine. The time of a run-time load, of a
swap-in per request, and a load's effect on streams in flight: benchmarks/lora_swap.py.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from lora_steps import make_adapters  # noqa: E402
from switchyard.core.testing.serving import free_port, wait_healthy

PROMPT = "Write a short story about a lighthouse keeper who"


class Server:
    """One `switchyard serve` of the default model with adapters named at start; its output goes to
    a file (a pipe nobody reads would fill and stop it), shown if it never becomes healthy."""

    def __init__(self, adapters: list[tuple[str, str]], max_loras: int, rank: int, budget: int = 16384,
                 extra: tuple[str, ...] = ()):
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--hostname", "127.0.0.1", "--port", str(port),
             "--max-batch-total-tokens", str(budget), "--max-lora-rank", str(rank), "--max-loras", str(max_loras),
             "--lora-adapters", ",".join(f"{n}={p}" for n, p in adapters), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def __enter__(self) -> str:
        try:
            wait_healthy(self.proc, self.base, 600)
        except AssertionError as exc:
            self.__exit__()
            self.log.seek(0)
            raise SystemExit(f"{exc}\n{self.log.read()[-4000:]}") from None
        return self.base

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def run(base: str, models: list[str], tokens: int) -> float:
    """Output tok/s of the requests, all sent at once."""
    async with httpx.AsyncClient(base_url=base, timeout=1200) as client:
        async def one(model: str) -> int:
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
                "temperature": 0})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(m) for m in models))
        return sum(counts) / (time.perf_counter() - start)


def rows(base: str, names: list[str], requests: int, tokens: int, with_base: bool) -> dict[str, float]:
    asyncio.run(run(base, (names or ["default"])[:4], 16))  # warm-up
    out = {}
    if with_base:
        out["base"] = asyncio.run(run(base, ["default"] * requests, tokens))
    out["adapters"] = asyncio.run(run(base, [names[i % len(names)] for i in range(requests)], tokens))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        adapters = make_adapters(root, args.adapters, args.rank)
        names = [n for n, _ in adapters]
        results = {}
        for label, max_loras, with_base in (("resident", args.adapters, True), ("swapping", 2, False)):
            with Server(adapters, max_loras, args.rank) as base:
                for row, value in rows(base, names, args.requests, args.tokens, with_base).items():
                    results[row if label == "resident" else "swapping"] = value
    print(f"{args.requests} requests at once, {args.tokens} output tokens each, {args.adapters} adapters of rank "
          f"{args.rank} on every projection; output tok/s")
    for row, value in results.items():
        print(f"  {row:<9} {value:8.1f}   ({value / results['base']:.2f}x base)")


if __name__ == "__main__":
    main()
