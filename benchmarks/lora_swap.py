"""What swapping LoRA adapters costs at run time, through `switchyard serve` as users run it.

    python benchmarks/lora_swap.py [--adapters 8] [--rank 16] [--loads 10] [--quick]

Adapters: PEFT adapters of rank --rank on every projection of the default model (made by peft over
its shapes, benchmarks/lora_steps.py make_adapter), and the same written as llama.cpp's LoRA .gguf
file (core/testing/lora_gguf.py, the converter's layout). Servers: the default model on its default
path, bound to 127.0.0.1, --max-batch-total-tokens 4096, the --adapters PEFT adapters named at
start, --enable-lora. Three tables:

(a) load / unload: the time of POST /v1/load_lora_adapter and /v1/unload_lora_adapter of one more
    adapter, PEFT directory and .gguf, median (and max) of --loads, after one untimed pair. A load
    reads and checks the files into host memory; the copy into a slot is a swap-in, (b).
(b) swap-in against resident: requests in turn over the adapters, each adapter --run times in a
    row (a0 a0 a1 a1 ...), at concurrency 1 and 8, on a server with --max-loras 2 (fewer slots than
    adapters: the LRU evicts) and on one with every adapter resident (--max-loras = --adapters).
    Per row: output tok/s, and the TTFT (p50, p90) of the requests whose adapter is resident when
    sent and of those that need a swap-in. Which is which is the engine's LRU replayed on the
    client (resident_when_sent): exact at concurrency 1; at 8 it is a guess (requests overlap, and
    a request for one adapter more than the slots also waits for a slot, core/scheduling/adapters.py).
(c) streams in flight: the gaps between the chunks (tokens) of one running stream (adapter a0),
    p50, p99 and max, on its own and while adapters are loaded and unloaded back to back (PEFT,
    then .gguf) for as long as it runs: a load's reading should not stall the step loop.

Each request: a short prompt, its output tokens forced (ignore_eos, min_tokens), streamed. Times
are the client's. Benchmark only an idle machine; --quick is a smoke run (4 adapters, few and short
requests), its figures mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import httpx

from switchyard.core.testing.lora_gguf import default_model_gguf_adapter
from switchyard.gateway.bench.figures import percentile
from switchyard.gateway.bench.loadgen import RequestRecord, drive, make_client, stream_one

sys.path.insert(0, os.path.dirname(__file__))
from lora_serving import PROMPT, Server  # noqa: E402
from lora_steps import make_adapter, make_adapters  # noqa: E402

def body(model: str, tokens: int) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def ms(values: list[float], q: float) -> str:
    value = percentile(values, q)
    return "-" if value is None else f"{value * 1000:.1f}"


# -- (a) load / unload -------------------------------------------------------------------------
def _call(base: str, route: str, payload: dict) -> float:
    start = time.perf_counter()
    r = httpx.post(base + route, json=payload, timeout=600)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise SystemExit(f"{route} {payload}: {r.status_code} {r.text}")
    return elapsed


def load_unload(base: str, formats: dict[str, str], loads: int) -> list[tuple[str, list[float], list[float]]]:
    rows = []
    for label, path in formats.items():
        _call(base, "/v1/load_lora_adapter", {"lora_name": f"warm-{label}", "lora_path": path})
        _call(base, "/v1/unload_lora_adapter", {"lora_name": f"warm-{label}"})
        load, unload = [], []
        for i in range(loads):
            name = f"timed-{label}-{i}"
            load.append(_call(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}))
            unload.append(_call(base, "/v1/unload_lora_adapter", {"lora_name": name}))
        rows.append((label, load, unload))
    return rows


# -- (b) swap-in against resident --------------------------------------------------------------
def resident_when_sent(sent: list[tuple[str, RequestRecord]], slots: int) -> list[bool]:
    """Whether each request's adapter was resident when it was sent (sent: (adapter, record) of
    every request, warm-up included), by the engine's rule replayed on the client: the `slots`
    adapters used most recently before it are resident, an adapter being used at each chunk of its
    requests (a request not yet streaming may still wait for a slot). Exact when requests do not
    overlap (concurrency 1); a guess when they do."""
    out = []
    for model, record in sent:
        last_use: dict[str, float] = {}
        for other_model, other in sent:
            used = [t for t in other.chunk_times if t <= record.start]
            if other is not record and used:
                last_use[other_model] = max(last_use.get(other_model, 0.0), max(used))
        out.append(model in sorted(last_use, key=last_use.__getitem__, reverse=True)[:slots])
    return out


async def swap_row(base: str, names: list[str], slots: int, concurrency: int, requests: int, run: int,
                   tokens: int) -> dict:
    models = [names[(i // run) % len(names)] for i in range(requests)]
    async with make_client(base, concurrency, 1200) as client:
        warm, _ = await drive(client, "/v1/completions", [body(n, 4) for n in names], 1)  # each adapter once
        records, elapsed = await drive(client, "/v1/completions", [body(m, tokens) for m in models], concurrency)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
    hits = resident_when_sent(list(zip(names + models, warm + records)), slots)[len(names):]
    return {"tok/s": sum(r.output_tokens for r in records) / elapsed,
            "resident": [r.ttft for r, hit in zip(records, hits) if hit],
            "swap-in": [r.ttft for r, hit in zip(records, hits) if not hit]}


# -- (c) streams in flight ---------------------------------------------------------------------
async def stream_gaps(base: str, tokens: int, formats: dict[str, str] | None) -> tuple[list[float], int]:
    """The chunk gaps of one stream on a0, with adapters loaded and unloaded back to back while it
    runs (formats: label -> path), or not (None); and how many loads completed."""
    async with make_client(base, 2, 1200) as client:
        stream = asyncio.create_task(stream_one(client, "/v1/completions", body("a0", tokens)))
        done = 0
        while formats and not stream.done():
            for label, path in formats.items():
                name = f"inflight-{label}-{done}"
                for route, payload in (("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}),
                                       ("/v1/unload_lora_adapter", {"lora_name": name})):
                    r = await client.post(route, json=payload)
                    if r.status_code != 200:
                        raise SystemExit(f"{route}: {r.status_code} {r.text}")
                done += 1
        record = await stream
    if not record.ok:
        raise SystemExit(f"the stream failed: {record.error}")
    return record.itls, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--loads", type=int, default=10, help="(a): timed loads and unloads per format")
    parser.add_argument("--requests", type=int, default=32, help="(b): requests per row")
    parser.add_argument("--run", type=int, default=2, help="(b): requests per adapter in a row")
    parser.add_argument("--tokens", type=int, default=64, help="(b): output tokens per request")
    parser.add_argument("--stream-tokens", type=int, default=256, help="(c): output tokens of the stream")
    parser.add_argument("--slots", type=int, default=2, help="(b): --max-loras of the swapping server")
    parser.add_argument("--max-batch-total-tokens", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few, short requests")
    args = parser.parse_args()
    if args.quick:
        args.adapters, args.loads, args.requests, args.tokens, args.stream_tokens = 4, 2, 8, 8, 48
    concurrencies = (1, 8)

    with tempfile.TemporaryDirectory() as root:
        adapters = make_adapters(root, args.adapters, args.rank)
        names = [n for n, _ in adapters]
        extra = os.path.join(root, "extra")
        make_adapter(extra, args.rank)
        formats = {"PEFT": extra, ".gguf": default_model_gguf_adapter(extra, os.path.join(root, "extra.gguf"))}

        swaps = {}
        with Server(adapters, args.adapters, args.rank, args.max_batch_total_tokens, ("--enable-lora",)) as base:
            timed = load_unload(base, formats, args.loads)
            quiet, _ = asyncio.run(stream_gaps(base, args.stream_tokens, None))
            busy, loads_done = asyncio.run(stream_gaps(base, args.stream_tokens, formats))
            for c in concurrencies:
                swaps[(c, args.adapters)] = asyncio.run(
                    swap_row(base, names, args.adapters, c, args.requests, args.run, args.tokens))
        with Server(adapters, args.slots, args.rank, args.max_batch_total_tokens, ("--enable-lora",)) as base:
            for c in concurrencies:
                swaps[(c, args.slots)] = asyncio.run(
                    swap_row(base, names, args.slots, c, args.requests, args.run, args.tokens))

    print(f"the default model, adapters of rank {args.rank} on every projection"
          f"{'  (--quick: a smoke run, the figures mean nothing)' if args.quick else ''}")
    print(f"\n(a) run-time load / unload, ms, median and max of {args.loads}")
    print(f"  {'format':<7} {'load p50':>9} {'load max':>9} {'unload p50':>11} {'unload max':>11}")
    for label, load, unload in timed:
        print(f"  {label:<7} {statistics.median(load) * 1000:9.1f} {max(load) * 1000:9.1f} "
              f"{statistics.median(unload) * 1000:11.1f} {max(unload) * 1000:11.1f}")

    print(f"\n(b) {args.requests} requests over {args.adapters} adapters, {args.run} in a row each, {args.tokens} "
          f"output tokens; TTFT ms of requests whose adapter is resident when sent / needs a swap-in "
          f"(exact at concurrency 1, a guess above)")
    print(f"  {'conc':>4} {'max-loras':>9} {'tok/s':>8} {'vs resident':>11} {'resident p50':>12} {'p90':>7} "
          f"{'(n)':>4} {'swap-in p50':>11} {'p90':>7} {'(n)':>4}")
    for (c, slots), row in sorted(swaps.items(), key=lambda item: (item[0][0], -item[0][1])):
        ratio = row["tok/s"] / swaps[(c, args.adapters)]["tok/s"]
        print(f"  {c:>4} {slots:>9} {row['tok/s']:8.1f} {ratio:10.2f}x {ms(row['resident'], 50):>12} "
              f"{ms(row['resident'], 90):>7} {len(row['resident']):>4} {ms(row['swap-in'], 50):>11} "
              f"{ms(row['swap-in'], 90):>7} {len(row['swap-in']):>4}")

    print(f"\n(c) one stream of {args.stream_tokens} tokens on a0: gaps between its chunks, ms")
    print(f"  {'while':<34} {'p50':>7} {'p99':>7} {'max':>7}")
    for label, gaps in (("nothing else", quiet), (f"{loads_done} loads+unloads (PEFT, .gguf)", busy)):
        print(f"  {label:<34} {ms(gaps, 50):>7} {ms(gaps, 99):>7} {max(gaps) * 1000:7.1f}")


if __name__ == "__main__":
    main()
