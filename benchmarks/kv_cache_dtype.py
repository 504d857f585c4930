"""What a quantized KV cache (--kv-cache-dtype) costs in accuracy and gives or takes in speed, on the
default model as `switchyard serve` runs it (its GGUF blocks, dtype auto, every step in C++),
beside llama.cpp's q8_0 KV cache on the same file and text.

    python benchmarks/kv_cache_dtype.py [--dtypes int8 fp8_e4m3fn fp8_e5m2] [--ctx 512] [--text FILE]
                                        [--llama native | none] [--concurrency 32] [--prompt-tokens 128 512]
                                        [--new-tokens 64] [--threads N] [--skip-accuracy] [--skip-speed]

Accuracy (benchmarks/accuracy.py's method): the text (default benchmarks/data/accuracy_text.txt) in
windows of --ctx tokens, the second half of each window scored; KL(float cache || quantized cache)
of the next-token distributions, the same weights and arithmetic otherwise (the float cache is
float32: dtype auto is float32 for GGUF blocks), top-1 agreement and perplexity. On this path every
prompt token is a decode row attending over the cache its step wrote, so the scored positions read
the quantized cache as decodes do. llama.cpp (--llama native: $PEERS/llama-server-build):
  llama-perplexity -m FILE -f TEXT -c CTX -t 2 -fa on --kl-divergence-base BASE        (F16 K and V)
  llama-perplexity -m FILE --kl-divergence-base BASE --kl-divergence -c CTX -t 2 -fa on -ctk q8_0 -ctv q8_0
(flash attention on in both: llama.cpp needs it for a quantized V cache), and Switchyard scores the
same token windows llama-perplexity evaluated.

Speed: --concurrency requests at once, each a prompt of --prompt-tokens tokens and --new-tokens
greedy tokens (EOS ignored), through one engine per cache in this process, stepped in turn (one
step each, so that a noisy neighbour slows them alike); decode tok/s counts the tokens of
decode-only steps over their time (prefill excluded), with the median decode step. And one
layer's decode attention alone (the in-place C++ kernel, SmolLM2's shapes, --concurrency decodes
of about --kernel-context tokens each, float32 queries): the minimum over calls alternating
between the caches (benchmarks/cpu_decode_attention.py's method). On a shared 2-core machine these
figures are noisy; --threads 1 keeps OpenMP's barriers from waiting on a descheduled thread.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import accuracy  # noqa: E402  (benchmarks/accuracy.py: windows, logits, KL, llama.cpp's base file)

FORMATS = ("int8", "fp8_e4m3fn", "fp8_e5m2")


def llama_kv_kl(text: str, ctx: int, work: str) -> tuple[dict, str]:
    """llama.cpp's KL of a q8_0 K and V cache against its F16 cache on the default model's file, and its base file."""
    from switchyard.core.loader.source import default_model_path

    binary = os.path.join(accuracy.LLAMA_BUILDS["native"], "bin/llama-perplexity")
    path, base = default_model_path(), os.path.join(work, f"kv-cache-f16-c{ctx}.kld-base.dat")
    common = ["-c", str(ctx), "-t", "2", "-fa", "on"]
    t0 = time.perf_counter()
    accuracy.run([binary, "-m", path, "-f", text, *common, "--kl-divergence-base", base],
                 os.path.join(work, f"kv-cache-f16-c{ctx}.base.log"))
    out = accuracy.run([binary, "-m", path, "--kl-divergence-base", base, "--kl-divergence", *common,
                        "-ctk", "q8_0", "-ctv", "q8_0"], os.path.join(work, f"kv-cache-q8_0-c{ctx}.kld.log"))

    def num(pattern: str) -> float | None:
        import re

        match = re.search(pattern, out)
        return float(match.group(1)) if match else None

    return dict(mean_kl=num(r"Mean\s+KLD:\s+(-?[\d.]+)"), p99_kl=num(r"99\.0%\s+KLD:\s+(-?[\d.]+)"),
                max_kl=num(r"Maximum KLD:\s+(-?[\d.]+)"), top1_pct=num(r"Same top p:\s+([\d.]+)"),
                ppl=num(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"), ppl_ref=num(r"Mean PPL\(base\)\s*:\s*([\d.]+)"),
                seconds=round(time.perf_counter() - t0, 1)), base


def measure_accuracy(args) -> list[tuple[str, str, dict]]:
    """(engine, cache, KL figures) rows."""
    from switchyard.core.loader.source import default_model_path

    path = default_model_path()
    rows, wins = [], None
    if args.llama == "native":
        figures, base = llama_kv_kl(args.text, args.ctx, args.work)
        rows.append(("llama.cpp", "q8_0 K and V vs F16", figures))
        n_ctx, _, n_chunk, tokens, _ = accuracy.read_kld_base(base)
        os.remove(base)  # 2 bytes per vocabulary entry and scored position
        wins = [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunk)]
    if wins is None:
        ids, add_bos, bos = accuracy.tokens_of(path, args.text)
        wins = accuracy.windows(ids, args.ctx, add_bos, bos)
    accuracy.log(f"{len(wins)} windows of {args.ctx} tokens")
    floats, info = accuracy.switchyard_logits(path, wins, args.ctx, served=True, isa="auto")
    accuracy.log(f"float cache ({info['dtype']}): score {info['score_s']} s")
    for name in args.dtypes:
        quantized, info = accuracy.switchyard_logits(path, wins, args.ctx, served=True, isa="auto",
                                                     kv_cache_dtype=name)
        figures = accuracy.compare(floats, quantized, wins, args.ctx)
        rows.append(("switchyard", f"{name} vs float32", figures))
        accuracy.log(f"{name}: KL {figures['mean_kl']:.3e}, top-1 {figures['top1_pct']:.2f}%, "
                     f"score {info['score_s']} s")
    return rows


def start_engine(kv_cache_dtype: str, concurrency: int, prompt_tokens: int, new_tokens: int):
    """An engine serving `concurrency` requests of `prompt_tokens` prompt tokens (distinct windows of
    the accuracy text: no shared prefix) and `new_tokens` greedy tokens each, not stepped yet."""
    from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.loader import load_tokenizer
    from switchyard.core.params import SamplingParams
    from switchyard.core.scheduling.request import Request

    blocks = concurrency * -(-(prompt_tokens + new_tokens + 64) // 16) + 1
    config = EngineConfig(model=ModelConfig(dtype="auto"), compile_decode=True,
                          cache=CacheConfig(num_blocks=blocks, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=concurrency, max_num_batched_tokens=2048))
    tokenizer = load_tokenizer(config.model)
    engine = EngineCore(config, tokenizer=tokenizer)
    text = open(os.path.join(HERE, "data/accuracy_text.txt"), encoding="utf-8").read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(concurrency):
        start = (i * 97) % max(1, len(ids) - prompt_tokens)
        engine.add_request(Request(f"r{i}", ids[start:start + prompt_tokens], params))
    return engine


def kernel_microseconds(args, context: int) -> dict[str, float]:
    """One layer's in-place decode attention over each cache, in microseconds (the minimum)."""
    import random

    from cpu_decode_attention import BLOCK, HEADS, HEAD_DIM, KV_HEADS, decode_meta

    from switchyard.backends.cpu.attention import CpuAttentionKernel, StepPlanCache
    from switchyard.backends.cpu.extension import PagedDecode
    from switchyard.core.backend import AttentionSpec
    from switchyard.core.kv.quantized import quantize_rows
    from switchyard.core.loader.gguf_cache import default_cache_root

    decode = PagedDecode()
    decode.load(default_cache_root())
    num_blocks = args.concurrency * (context + 40) // BLOCK * 2
    meta = decode_meta(args.concurrency, context, num_blocks, random.Random(0))
    values = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    query = torch.randn(args.concurrency, HEADS, HEAD_DIM)
    runs = []
    for name in ("auto", *args.dtypes):
        spec = AttentionSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                             scale=HEAD_DIM ** -0.5, kv_cache_dtype=name)
        cache = values if name == "auto" else quantize_rows(values, spec.cache_dtype).view(spec.cache_dtype)
        runs.append((name, CpuAttentionKernel(spec, decode=decode), cache, []))
    with torch.inference_mode():
        for _ in range(args.repeat + 2):
            for _, kernel, cache, spent in runs:
                kernel._plans = StepPlanCache()
                began = time.perf_counter()
                kernel.forward(query, cache, meta)
                spent.append(time.perf_counter() - began)
    return {name: min(spent[2:]) * 1e6 for name, _, _, spent in runs}


def measure_speed(args) -> dict[tuple[str, int], tuple[float, float]]:
    """(cache, prompt tokens) -> (decode tok/s, median decode step in ms). One engine per cache in
    this process, stepped in turn, one step each (so that a noisy neighbour slows them alike);
    decode tok/s counts the tokens of decode-only steps over their time (prefill excluded)."""
    import statistics

    results = {}
    for prompt_tokens in args.prompt_tokens:
        names = ("auto", *args.dtypes)
        engines = {name: start_engine(name, args.concurrency, prompt_tokens, args.new_tokens) for name in names}
        steps: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
        try:
            while any(engine.has_unfinished_requests() for engine in engines.values()):
                for name, engine in engines.items():
                    if not engine.has_unfinished_requests():
                        continue
                    began = time.perf_counter()
                    outputs = engine.step()
                    elapsed = time.perf_counter() - began
                    scheduled = engine.last_scheduler_output.scheduled
                    if scheduled and all(s.num_new_tokens == 1 for s in scheduled):
                        steps[name].append((elapsed, sum(len(o.new_token_ids) for o in outputs)))
        finally:
            for engine in engines.values():
                engine.shutdown()
        for name, timed in steps.items():
            rate = sum(n for _, n in timed) / sum(t for t, _ in timed)
            results[name, prompt_tokens] = (rate, 1e3 * statistics.median(t for t, _ in timed))
            accuracy.log(f"prompt {prompt_tokens}, {name}: {rate:.1f} decode tok/s, "
                         f"median step {results[name, prompt_tokens][1]:.1f} ms over {len(timed)} steps")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--text", default=os.path.join(HERE, "data/accuracy_text.txt"))
    parser.add_argument("--work", default=os.path.join(accuracy.PEERS, "accuracy"))
    parser.add_argument("--llama", default="native", choices=("native", "none"))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, nargs="*", default=[128, 512], help="none: no engine runs")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kernel-context", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--repeat", type=int, default=200, help="kernel calls per cache")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: torch's); 1 is steadier on a busy machine")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    torch.set_num_threads(args.threads or min(torch.get_num_threads(), os.cpu_count() or 1))
    if not args.skip_accuracy:
        rows = measure_accuracy(args)
        print(f"\nKL(float cache || quantized cache), windows of {args.ctx}, second halves scored")
        print("| engine | KV cache | mean KL | p99 KL | max KL | top-1 % | PPL | PPL float cache |")
        print("|---|---|---|---|---|---|---|---|")
        for engine, cache, m in rows:
            cells = [engine, cache, *(accuracy.fmt(m.get(k), ".3e") for k in ("mean_kl", "p99_kl", "max_kl")),
                     accuracy.fmt(m.get("top1_pct"), ".2f"), accuracy.fmt(m.get("ppl"), ".3f"),
                     accuracy.fmt(m.get("ppl_ref"), ".3f")]
            print("| " + " | ".join(cells) + " |")
    if not args.skip_speed:
        print(f"\none layer's in-place decode attention, {args.concurrency} decodes, float32 queries "
              f"(minimum of {args.repeat} alternating calls, microseconds)")
        print("| context | " + " | ".join(("auto (float32)", *args.dtypes)) + " |")
        print("|---|" + "---|" * (1 + len(args.dtypes)))
        for context in args.kernel_context:
            times = kernel_microseconds(args, context)
            cells = [f"{times['auto']:.0f}"] + [f"{times[n]:.0f} ({times['auto'] / times[n]:.2f}x)"
                                                for n in args.dtypes]
            print(f"| {context} | " + " | ".join(cells) + " |", flush=True)
        results = measure_speed(args)
        if not results:
            return 0
        print(f"\ndecode at {args.concurrency} requests at once, {args.new_tokens} new tokens each, "
              f"{torch.get_num_threads()} thread(s): tok/s (median step ms); the engines stepped in turn")
        print("| prompt tokens | " + " | ".join(("auto", *args.dtypes)) + " |")
        print("|---|" + "---|" * (1 + len(args.dtypes)))
        for prompt_tokens in args.prompt_tokens:
            auto, _ = results["auto", prompt_tokens]
            cells = [f"{rate:.1f} ({ms:.0f} ms)" + ("" if name == "auto" else f", {rate / auto:.2f}x")
                     for name in ("auto", *args.dtypes) for rate, ms in [results[name, prompt_tokens]]]
            print(f"| {prompt_tokens} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
