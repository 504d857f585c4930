"""Offline throughput: Switchyard's LLM API at several concurrencies vs transformers
`generate` one request at a time, same model, same dtype, same prompts, one run.

    python benchmarks/offline_throughput.py [--dtype float32] [--new-tokens 128]

Run it alone: two torch processes on a 2-core machine slow each other 2-10x.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

PROMPT_TOPICS = ["the ocean", "a lighthouse keeper", "compilers", "bread baking", "the moon landing",
                 "a chess game", "volcanoes", "a jazz band", "honey bees", "the printing press",
                 "a mountain railway", "quantum computers", "a city at night", "ancient Rome",
                 "migratory birds", "a small bookshop"]


def make_prompts(n: int) -> list[str]:
    return [f"Write a detailed essay about {PROMPT_TOPICS[i % len(PROMPT_TOPICS)]} (part {i}):" for i in range(n)]


def bench_switchyard(args, concurrency: int, num_requests: int) -> float:
    from switchyard.core import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=concurrency, num_kv_blocks=args.kv_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(make_prompts(2), SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    results = llm.generate(make_prompts(num_requests), params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == num_requests * args.new_tokens
    return tokens / elapsed


def bench_transformers(args, num_requests: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import resolve_source

    source = resolve_source(ModelConfig(model=args.model))
    # A GGUF source resolves to its converted HF directory: the same dequantized weights.
    kwargs = {"gguf_file": os.path.basename(source.path)} if source.kind == "gguf" else {}
    directory = source.directory
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype), **kwargs).eval()
    prompts = make_prompts(num_requests)
    tokens = 0
    with torch.inference_mode():
        warm = tokenizer(prompts[0], return_tensors="pt")
        model.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        for prompt in prompts:
            inputs = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**inputs, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=0)
            tokens += out.shape[1] - inputs["input_ids"].shape[1]
        elapsed = time.perf_counter() - start
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF, dequantized)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-slot", type=int, default=2, help="N = concurrency x this (at least 4)")
    parser.add_argument("--baseline-requests", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}, "
          f"{args.new_tokens} new tokens, EOS ignored")
    baseline = bench_transformers(args, args.baseline_requests)
    print(f"transformers generate, sequential ({args.baseline_requests} requests): {baseline:8.1f} tok/s")
    for concurrency in args.concurrency:
        n = max(4, concurrency * args.requests_per_slot)
        ours = bench_switchyard(args, concurrency, n)
        print(f"switchyard concurrency {concurrency:>3} ({n:>3} requests): {ours:8.1f} tok/s"
              f"  = {ours / baseline:5.2f}x sequential transformers")


if __name__ == "__main__":
    main()
