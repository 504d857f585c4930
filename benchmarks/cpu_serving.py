"""Serving on this CPU, in one run, side by side: Switchyard through HTTP vs transformers.

    python benchmarks/cpu_serving.py [--dtype bfloat16] [--quick]

1. transformers `generate`, one request at a time, and in static batches of 32
   (left-padded), on the same converted weights and dtype;
2. `switchyard serve` (a subprocess) driven by streaming clients at concurrency 1, 8,
   32 and 64 (/v1/completions, `--new-tokens` new tokens, EOS ignored), with time to
   first token and inter-token latency percentiles;
3. a shared-prefix workload: `--prefix-requests` requests at once, all starting with
   the same `--prefix-tokens`-token system prompt (sent as token ids, so the prefix is
   exact), against a server with prefix caching and one started with
   `--disable-prefix-caching`. One request with the system prompt goes first, as in a
   server that has already seen it; the figures are of the concurrent requests.

Ratios are output tokens/s over sequential transformers (aims on the 2-core CI CPU:
>= 3x at concurrency 1, >= 30x at 32) and cached over uncached TTFT (aim: >= 5x).
Run it alone: clients, server and baselines share the machine's cores (a second
torch process on the 2-core machine slows everything several-fold). Alone, a full
run takes a few minutes there and `--quick` about 20 seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from http_load import load, percentile, start_server  # noqa: E402
from offline_throughput import make_prompts  # noqa: E402


def load_transformers(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import resolve_source

    source = resolve_source(ModelConfig(model=args.model))
    # A GGUF source resolves to its converted HF directory: the weights the engine serves.
    kwargs = {"gguf_file": os.path.basename(source.path)} if source.kind == "gguf" else {}
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=getattr(torch, args.dtype), **kwargs)
    return tokenizer, model.eval()


def transformers_baselines(args) -> dict[str, float]:
    """Output tokens/s of `generate`: sequential, and static batches of `batch`."""
    import torch

    tokenizer, model = load_transformers(args)
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad_id)
    figures = {}
    with torch.inference_mode():
        model.generate(**tokenizer(make_prompts(1), return_tensors="pt"), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad_id)  # warm-up
        tokens, start = 0, time.perf_counter()
        for prompt in make_prompts(args.baseline_requests):
            inputs = tokenizer(prompt, return_tensors="pt")
            tokens += model.generate(**inputs, **gen).shape[1] - inputs["input_ids"].shape[1]
        figures["sequential"] = tokens / (time.perf_counter() - start)
        print(f"  transformers sequential: {figures['sequential']:.1f} tok/s", flush=True)
        prompts = make_prompts(args.batch * args.baseline_batches)
        tokens, start = 0, time.perf_counter()
        for i in range(0, len(prompts), args.batch):
            inputs = tokenizer(prompts[i:i + args.batch], return_tensors="pt", padding=True)
            out = model.generate(**inputs, **gen)
            tokens += out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1])
        figures[f"static batch {args.batch}"] = tokens / (time.perf_counter() - start)
        print(f"  transformers static batch {args.batch}: {figures[f'static batch {args.batch}']:.1f} tok/s", flush=True)
    return figures


def shared_prefix_prompts(args) -> tuple[list[int], list[list[int]]]:
    """(the system prompt's token ids, one prompt per request: system prompt + its own question)."""
    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model=args.model))
    text = " ".join(f"Rule {i}: answer about {topic} politely, briefly and with one example."
                    for i, topic in enumerate(make_prompts(64) * 8))
    system = tokenizer.encode(text, add_special_tokens=False)[:args.prefix_tokens]
    assert len(system) == args.prefix_tokens, "the system prompt text is too short"
    questions = [tokenizer.encode(f"\nQuestion {i}: {p}", add_special_tokens=False)
                 for i, p in enumerate(make_prompts(args.prefix_requests))]
    return system, [system + q for q in questions]


def row(name: str, tok_s: float, baseline: float | None, result: dict | None = None) -> str:
    ratio = f"{tok_s / baseline:7.1f}x" if baseline else f"{'':>8}"
    line = f"{name:<50} {tok_s:>9.1f} {ratio}"
    if result:
        ttft, itl = result["ttft"], result["itl"]
        line += (f" {percentile(ttft, .5) * 1e3:>8.0f} {percentile(ttft, .99) * 1e3:>8.0f}"
                 f" {percentile(itl, .5) * 1e3:>7.1f} {percentile(itl, .99) * 1e3:>7.1f}")
    return line


def serve_and_load(args, flags: tuple[str, ...], runs) -> list[dict]:
    """Starts a server with `flags`, warms it up, runs each (label, concurrency, rounds,
    new_tokens, prompts) of `runs` in turn, stops it."""
    proc, url = start_server(args, flags)
    try:
        asyncio.run(load(url, 2, 1, 8))  # warm-up
        results = []
        for label, c, rounds, new_tokens, prompts in runs:
            results.append(asyncio.run(load(url, c, rounds, new_tokens, prompts)))
            print(f"  HTTP{' ' + ' '.join(flags) if flags else ''}, {label}: {results[-1]['tok_s']:.1f} tok/s, "
                  f"TTFT p50 {percentile(results[-1]['ttft'], .5) * 1e3:.0f} ms", flush=True)
        return results
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def shared_prefix(args) -> dict[str, dict]:
    system, prompts = shared_prefix_prompts(args)
    results = {}
    for name, flags in (("prefix caching", ()), ("--disable-prefix-caching", ("--disable-prefix-caching",))):
        _, measured = serve_and_load(args, flags, [
            ("the system prompt alone (warm-up)", 1, 1, 1, [system]),
            (f"{len(prompts)} shared-prefix requests at once", len(prompts), 1, args.prefix_new_tokens, prompts)])
        results[name] = measured
    return results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests each HTTP client sends back to back")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--kv-blocks", type=int, default=8192)
    parser.add_argument("--baseline-requests", type=int, default=4, help="transformers, sequential")
    parser.add_argument("--batch", type=int, default=32, help="transformers static batch size")
    parser.add_argument("--baseline-batches", type=int, default=1)
    parser.add_argument("--prefix-requests", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--prefix-new-tokens", type=int, default=32)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small everything (about a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.rounds, args.concurrency = 16, 1, [1, 8]
        args.baseline_requests, args.batch = 1, 4
        args.prefix_requests, args.prefix_tokens, args.prefix_new_tokens = 8, 200, 4
        args.kv_blocks = min(args.kv_blocks, 1024)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, {args.dtype}, "
          f"{args.new_tokens} new tokens, EOS ignored", flush=True)
    baselines = {} if args.skip_transformers else transformers_baselines(args)
    sequential = baselines.get("sequential")
    runs = [(f"concurrency {c}", c, args.rounds, args.new_tokens, None) for c in args.concurrency]
    http = dict(zip(args.concurrency, serve_and_load(args, (), runs)))
    prefix = {} if args.skip_prefix else shared_prefix(args)

    print(f"\n{'workload':<50} {'tok/s':>9} {'vs seq':>8} {'TTFT p50':>8} {'TTFT p99':>8} "
          f"{'ITL p50':>7} {'ITL p99':>7}  (ms)")
    for name, tok_s in baselines.items():
        print(row(f"transformers {name}", tok_s, sequential))
    for c, result in http.items():
        print(row(f"switchyard HTTP, concurrency {c}", result["tok_s"], sequential, result))
    for name, result in prefix.items():
        label = f"{args.prefix_requests} x {args.prefix_tokens}-token prefix, {name}"
        print(row(label, result["tok_s"], None, result))
    if len(prefix) == 2:
        cached, uncached = prefix["prefix caching"], prefix["--disable-prefix-caching"]
        for q in (.5, .99):
            ratio = percentile(uncached["ttft"], q) / percentile(cached["ttft"], q)
            print(f"shared prefix: TTFT p{int(q * 100)} uncached / cached = {ratio:.1f}x (aim >= 5x)")
    if sequential:
        for c, aim in ((1, 3), (32, 30)):
            if c in http:
                print(f"HTTP concurrency {c} / transformers sequential = {http[c]['tok_s'] / sequential:.1f}x "
                      f"(aim >= {aim}x)")


if __name__ == "__main__":
    main()
