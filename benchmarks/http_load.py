"""Load through the HTTP gateway: streaming clients at concurrency 1, 8, 32, 64
against a live `switchyard serve`, next to the offline API on the same workload.

    python benchmarks/http_load.py [--dtype bfloat16] [--new-tokens 128] [--rounds 2]

Prints, per concurrency: output tokens/s, time to first token and inter-token
latency (p50/p99); then the HTTP/offline throughput ratios at concurrency 1 and 32 (the
gateway must not be the bottleneck: aim >= 0.9). Each client sends `rounds`
requests back to back (/v1/completions, stream, usage chunk, EOS ignored), through the
load generator of `switchyard bench serve` (which drives /v1/chat/completions of any
server, peers included: use that to compare servers).
The offline runs use LLM(max_num_seqs=32) on the same prompts: `rounds` requests one
after another (concurrency 1), and 32 * rounds with 32 running.
Run it alone: the clients, the server and the offline run share the 2 cores.

`--engine thread` serves with the engine in a thread of the gateway process (how
`switchyard serve` ran before the engine moved to its own process), for comparison;
the default is the engine process `switchyard serve` uses.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from switchyard.gateway.bench.figures import percentile as bench_percentile
from switchyard.gateway.bench.loadgen import drive, make_client

sys.path.insert(0, os.path.dirname(__file__))
from offline_throughput import make_prompts  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """q in 0..1; NaN for no values (switchyard bench's interpolated percentile)."""
    value = bench_percentile(values, q * 100)
    return float("nan") if value is None else value


def completion_body(prompt: str | list[int], new_tokens: int) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def load(url: str, concurrency: int, rounds: int, new_tokens: int,
               prompts: list[str] | list[list[int]] | None = None) -> dict:
    """`concurrency` clients sending `concurrency * rounds` requests, each client its next as
    soon as its last ends (prompts: text or token ids; default make_prompts), through
    `switchyard bench`'s load generator on /v1/completions."""
    prompts = prompts or make_prompts(concurrency * rounds)
    bodies = [completion_body(p, new_tokens) for p in prompts[:concurrency * rounds]]
    async with make_client(url, concurrency, 3600) as client:
        records, elapsed = await drive(client, "/v1/completions", bodies, concurrency)
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed; the first: {failed[0].error}")
    total_tokens = sum(r.output_tokens for r in records)
    assert total_tokens == len(bodies) * new_tokens, total_tokens
    return {"tok_s": total_tokens / elapsed, "ttft": [r.ttft for r in records if r.ttft is not None],
            "itl": [gap for r in records for gap in r.itls]}


def offline(args) -> dict[int, float]:
    """Offline API tokens/s on the same workload: 1 and 32 running."""
    from switchyard.core import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=32, num_kv_blocks=args.kv_blocks)
    llm.generate(make_prompts(2), SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    figures = {}
    for concurrency in (1, 32):
        prompts = make_prompts(concurrency * args.rounds)
        start = time.perf_counter()
        if concurrency == 1:
            tokens = sum(len(llm.generate([p], params)[0].token_ids) for p in prompts)
        else:
            tokens = sum(len(r.token_ids) for r in llm.generate(prompts, params))
        figures[concurrency] = tokens / (time.perf_counter() - start)
    return figures


# `switchyard serve` with the engine in a thread of the gateway process (the comparison)
_THREAD_SERVE = """
import sys
import switchyard.gateway.serve as serve
from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.engine.process import build_engine

class ThreadClient(InProcessEngineClient):
    def wait_model_checked(self, timeout=None):
        return "(engine in a thread)"

serve.make_engine_client = lambda config, json_output=False, *data_parallel: ThreadClient(lambda: build_engine(config))
from switchyard.gateway.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_server(args, extra_flags: tuple[str, ...] = (), engine: str = "process") -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = ["-m", "switchyard.gateway.cli"] if engine == "process" else ["-c", _THREAD_SERVE]
    cmd = [sys.executable, *launcher, "serve", "--port", str(port), "--dtype", args.dtype,
           "--num-kv-blocks", str(args.kv_blocks), "--max-batch-size", "64", *extra_flags]
    if args.model:
        cmd += ["--model-id", args.model]
    log = tempfile.TemporaryFile()  # the server's output, shown if it fails to start
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(3000):
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--engine", choices=["process", "thread"], nargs="+", default=["process"],
                        help="where the server's engine runs; several: one server each, in turn")
    args = parser.parse_args()

    offline_tok_s = offline(args)
    for c, tok_s in offline_tok_s.items():
        print(f"offline API, {c} running, {c * args.rounds} requests: {tok_s:8.1f} tok/s", flush=True)
    for engine in args.engine:
        results = serve_and_load(args, engine)
        for c in (1, 32):
            if c in results:
                ratio = results[c]["tok_s"] / offline_tok_s[c]
                print(f"engine {engine}: HTTP / offline throughput at concurrency {c}: {ratio:.2f} (aim >= 0.90)")
        print(f"engine {engine}: mean ITL: {statistics.fmean(i for r in results.values() for i in r['itl']) * 1e3:.1f} ms")


def serve_and_load(args, engine: str) -> dict[int, dict]:
    proc, url = start_server(args, engine=engine)
    results = {}
    try:
        asyncio.run(load(url, 2, 1, 8))  # warm-up
        print(f"engine {engine}:\n{'conc':>5} {'tok/s':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>9} "
              f"{'ITL p99':>9}")
        for c in args.concurrency:
            r = asyncio.run(load(url, c, args.rounds, args.new_tokens))
            results[c] = r
            print(f"{c:>5} {r['tok_s']:>9.1f} {percentile(r['ttft'], .5) * 1e3:>8.0f}ms "
                  f"{percentile(r['ttft'], .99) * 1e3:>8.0f}ms {percentile(r['itl'], .5) * 1e3:>7.1f}ms "
                  f"{percentile(r['itl'], .99) * 1e3:>7.1f}ms", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return results


if __name__ == "__main__":
    main()
