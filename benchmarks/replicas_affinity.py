"""Replicas and several models, measured (docs/deployment.md "Replicas", "Several models").

    python benchmarks/replicas_affinity.py affinity [--requests 64 --concurrency 8 --output-len 8]
    python benchmarks/replicas_affinity.py models [--second-priority normal|background] [--pin]

affinity: for each routing (cache-aware, round-robin), `switchyard serve --data-parallel-size 2`
(one core each on a 2-core machine) driven with the shared-prefix workload (8 system prompts of
~1,000 tokens, gateway/bench/shared_prefix.py): median TTFT, and the prefix-cache hit rate from
the server's /metrics (hit tokens / looked-up tokens of these requests).
models: two models behind one gateway (`--models`): the first's inter-token latency p99 while it
streams alone, then while the second (cold) loads and answers a request, and that cold first
request's latency; the second model's `priority` is --second-priority; --pin gives each model its
own half of the CPUs (the models file's `cpus`). Each engine's KV cache is
capped (--max-batch-total-tokens): 4096 tokens, and
for the affinity runs --kv-tokens (6144: a replica's half of the prompts fits, all 8 do not)."""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from switchyard.gateway.bench.loadgen import drive, make_client, stream_one
from switchyard.gateway.bench.workload import chat_bodies, chat_body
from switchyard.gateway.replicas import split_cpus
from switchyard.core.testing.serving import free_port


def _serve(*flags: str, kv_tokens: int = 4096) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--hostname", "127.0.0.1",
                             "--port", str(port), "--max-batch-total-tokens", str(kv_tokens), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def _wait(proc: subprocess.Popen, url: str, replicas: int = 1, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                metrics = _metrics(url)
                if replicas == 1 or all(metrics.get(f'switchyard_replica_up{{replica="{i}"}}') == 1
                                        for i in range(replicas)):
                    return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def hit_rate_ceiling(bodies: list[dict], block_size: int = 16) -> float:
    """The prefix-cache hit rate of `bodies` through one cache that never evicts, one request at a
    time: a request hits the full blocks (at most its length - 1 tokens) that an earlier one had."""
    from switchyard.core.text.chat_template import render_chat
    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig())
    seen: set[tuple[int, ...]] = set()
    queried = hit = 0
    for body in bodies:
        ids = tokenizer.encode(render_chat(tokenizer, body["messages"]), add_special_tokens=False)
        prefixes = [tuple(ids[:(k + 1) * block_size]) for k in range((len(ids) - 1) // block_size)]
        hit += block_size * next((k for k, prefix in enumerate(prefixes) if prefix not in seen), len(prefixes))
        queried += len(ids)
        seen.update(prefixes)
    return hit / queried


def affinity(args: argparse.Namespace) -> None:
    print(f"2 replicas x 1 core, {args.requests} requests over 8 system prompts of ~1,000 tokens, "
          f"c={args.concurrency}, {args.output_len} output tokens, {args.kv_tokens} KV tokens a replica "
          f"(machine: {os.cpu_count()} CPUs)")
    print(f"hit rate ceiling (one cache that never evicts, one request at a time): "
          f"{hit_rate_ceiling(chat_bodies('tgi', args.requests, args.output_len, kind='shared-prefix')):.1%}")
    for routing in args.routings:
        proc, url = _serve("--data-parallel-size", "2", "--data-parallel-routing", routing, kv_tokens=args.kv_tokens)
        try:
            _wait(proc, url, replicas=2)
            before = _metrics(url)
            bodies = chat_bodies("tgi", args.requests, args.output_len, kind="shared-prefix")

            async def run():
                async with make_client(url, args.concurrency, 900) as client:
                    return await drive(client, "/v1/chat/completions", bodies, args.concurrency)

            records, wall = asyncio.run(run())
            after = _metrics(url)
            queried, hits = (after[f"switchyard_prefix_cache_{name}_tokens"]
                             - before.get(f"switchyard_prefix_cache_{name}_tokens", 0) for name in ("queried", "hit"))
            ttfts = [r.ttft for r in records if r.ok and r.ttft is not None]
            errors = sum(not r.ok for r in records)
            routed = [after.get(f'switchyard_replica_routed_requests{{replica="{i}"}}', 0) for i in range(2)]
            print(f"{routing:12s} median TTFT {statistics.median(ttfts) * 1000:8.0f} ms  "
                  f"p90 {statistics.quantiles(ttfts, n=10)[-1] * 1000:8.0f} ms  prefix-cache hit rate "
                  f"{hits / max(1, queried):6.1%}  wall {wall:6.1f} s  routed {routed}  errors {errors}")
        finally:
            _stop(proc)


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[-1] if len(values) >= 2 else float("nan")


def models(args: argparse.Namespace) -> None:
    from switchyard.core.loader import default_model_path

    path = default_model_path()
    halves = split_cpus(os.sched_getaffinity(0), 2) if args.pin else None
    pins = [f"  cpus: {','.join(map(str, half))}\n" for half in halves] if halves else ["", ""]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"- name: first\n  source: {path}\n{pins[0]}"
                f"- name: second\n  source: {path}\n  priority: {args.second_priority}\n{pins[1]}")
    proc, url = _serve("--models", f.name)
    try:
        _wait(proc, url)
        long = {**chat_body("first", "Write a long story about a lighthouse.", args.stream_len)}

        async def alone():
            async with make_client(url, 4, 900) as client:
                return await stream_one(client, "/v1/chat/completions", long)

        async def with_cold_second():
            async with make_client(url, 4, 900) as client:
                first = asyncio.create_task(stream_one(client, "/v1/chat/completions", long))
                await asyncio.sleep(1.0)
                start = time.perf_counter()
                second = await stream_one(client, "/v1/chat/completions", chat_body("second", "Say hi.", 8))
                cold = time.perf_counter() - start
                return await first, second, cold

        base = asyncio.run(alone())
        during, second, cold = asyncio.run(with_cold_second())
        warm, _, warm_latency = asyncio.run(with_cold_second())  # the second is loaded now: its answer alone
        where = f"on CPUs {' and '.join(','.join(map(str, h)) for h in halves)}" if halves else \
            f"sharing {os.cpu_count()} CPUs"
        print(f"two models, 1 engine each {where}; the first streams {args.stream_len} tokens; "
              f"the second's priority: {args.second_priority}")
        print(f"first's ITL p99 alone {_p99(base.itls) * 1000:.1f} ms; while the second loads and answers "
              f"{_p99(during.itls) * 1000:.1f} ms ({_p99(during.itls) / _p99(base.itls) - 1:+.0%}); while the "
              f"loaded second answers {_p99(warm.itls) * 1000:.1f} ms ({_p99(warm.itls) / _p99(base.itls) - 1:+.0%}, "
              f"its request {warm_latency:.2f} s)")
        print(f"cold second model: first request {cold:.1f} s (TTFT {second.ttft or float('nan'):.1f} s, "
              f"{'ok' if second.ok else second.error})")
    finally:
        _stop(proc)
        os.unlink(f.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("affinity")
    a.add_argument("--requests", type=int, default=64)
    a.add_argument("--concurrency", type=int, default=8)
    a.add_argument("--output-len", type=int, default=8)
    a.add_argument("--routings", nargs="+", default=["cache-aware", "round-robin"])
    a.add_argument("--kv-tokens", type=int, default=6144,
                   help="KV cache per replica: room for its half of the system prompts (4 x ~1,030 tokens and "
                   "the requests in flight), not for all 8, as a replica's cache is where traffic is spread")
    m = sub.add_parser("models")
    m.add_argument("--stream-len", type=int, default=256)
    m.add_argument("--second-priority", choices=("normal", "background"), default="normal",
                   help="the second model's `priority` in the models file (gateway/models_registry.py)")
    m.add_argument("--pin", action="store_true", help="each model on its own half of the CPUs (`cpus`)")
    args = parser.parse_args()
    affinity(args) if args.what == "affinity" else models(args)


if __name__ == "__main__":
    main()
