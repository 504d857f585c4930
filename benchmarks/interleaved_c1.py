"""c=1 output tokens/s of two running servers, their requests interleaved (A, B, A, B, ...).

    python benchmarks/interleaved_c1.py --server llama=http://127.0.0.1:8104,m \
        --server switchyard=http://127.0.0.1:8110,MODEL [--tokens 64] [--rounds 6] [--output FILE.jsonl]

A c=1 decode of a model of a gigabyte or more reads its weights once a token, so its speed is this
machine's memory bandwidth at that moment, and on a shared host that moves by 20-30% within
minutes: two servers measured one after the other (benchmarks/gguf_side_by_side.sh) can differ by
the host alone. Here both servers are up at once and only one generates at a time: each round
sends one streaming chat request of `--tokens` forced tokens (greedy, ignore_eos) to each server in
turn, after two warm-up requests each. Printed: every round's tok/s per server (first token to
last), the medians, their ratio (the second server against the first) and each round's ratio.
Start both servers with few slots (llama-server -np 4): each holds its memory while the other runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def tokens_per_second(url: str, model: str, tokens: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"content"' in line:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="NAME=URL,MODEL (twice)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--output", default=None, help="append the figures as one JSON line")
    args = parser.parse_args()
    servers = {}
    for spec in args.server:
        name, rest = spec.split("=", 1)
        url, model = rest.rsplit(",", 1)
        servers[name] = (url, model)
    if len(servers) != 2:
        parser.error("give exactly two --server")
    for url, model in servers.values():
        for _ in range(2):
            tokens_per_second(url, model, args.tokens)
    rates: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, (url, model) in servers.items():
            rates[name].append(tokens_per_second(url, model, args.tokens))
    (first, a), (second, b) = rates.items()
    for name, values in rates.items():
        print(f"{name:<12} tok/s {' '.join(f'{v:.1f}' for v in values)}  median {statistics.median(values):.1f}")
    ratio = statistics.median(b) / statistics.median(a)
    print(f"{second} / {first}: {ratio:.2f} (medians); per round {' '.join(f'{y / x:.2f}' for x, y in zip(a, b))}")
    if args.output:
        with open(args.output, "a") as out:
            out.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokens": args.tokens,
                                  "servers": {name: {"url": servers[name][0], "model": servers[name][1],
                                                     "tok_s": rates[name]} for name in servers},
                                  "ratio_of_medians": ratio}) + "\n")


if __name__ == "__main__":
    main()
