"""Mixture-of-experts on this CPU, in one run, side by side with transformers.

    python benchmarks/moe_cpu.py [--quick] [--threads N]

1. One expert layer (Mixtral-style, top-2 of 8; --hidden/--intermediate sizes):
   our batched path (core/layers/fused_moe.py: one matmul pair per expert that has
   tokens) against transformers' own experts module (MixtralExperts, same weights),
   for 1, 8, 64 and 256 tokens in float32 and bfloat16.
2. A small random Mixtral end to end: the offline LLM (continuous batching, paged KV
   cache) at concurrency 1 and 8 against transformers `generate` one request at a
   time, output tokens/s, greedy, EOS ignored.
Run it alone: a second torch process on a 2-core machine slows everything several-fold.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def bench_layer(args) -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from switchyard.core.layers.fused_moe import fused_experts, select_experts

    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_local_experts=8,
                           num_experts_per_tok=2)
    print(f"expert layer: H={args.hidden} I={args.intermediate} E=8 top-2 (best of {args.repeats}, ms)")
    print(f"{'dtype':>9} {'tokens':>6} {'switchyard':>11} {'transformers':>13} {'speed-up':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        theirs = MixtralExperts(config).to(dtype).eval()
        with torch.no_grad():
            theirs.gate_up_proj.normal_(0, 0.02)
            theirs.down_proj.normal_(0, 0.02)
        w13, w2 = theirs.gate_up_proj.detach(), theirs.down_proj.detach()
        for tokens in args.tokens:
            hidden = torch.randn(tokens, args.hidden).to(dtype)
            weights, ids = select_experts(torch.randn(tokens, 8), 2, renormalize=True)
            with torch.no_grad():
                ours_ms = _best_ms(lambda: fused_experts(hidden, w13, w2, weights, ids), args.repeats)
                theirs_ms = _best_ms(lambda: theirs(hidden, ids, weights.to(dtype)), args.repeats)
            name = str(dtype).removeprefix("torch.")
            print(f"{name:>9} {tokens:>6} {ours_ms:>11.2f} {theirs_ms:>13.2f} {theirs_ms / ours_ms:>7.1f}x")


def bench_end_to_end(args) -> None:
    from transformers import AutoModelForCausalLM, MixtralConfig

    from switchyard.core.llm import LLM
    from switchyard.core.loader import dummy_tokenizer
    from switchyard.core.params import SamplingParams

    config = MixtralConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
    path = tempfile.mkdtemp(prefix="moe-bench-")
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(path)
    dummy_tokenizer(config.vocab_size).save_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (32,), generator=generator).tolist() for _ in range(8)]
    new_tokens = args.new_tokens

    start = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        do_sample=False, pad_token_id=0)
    hf_rate = len(prompts) * new_tokens / (time.perf_counter() - start)

    llm = LLM(model=path, backend="cpu", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    rates = {}
    for concurrency in (1, 8):
        start = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            llm.generate(prompts[i:i + concurrency], params)
        rates[concurrency] = len(prompts) * new_tokens / (time.perf_counter() - start)
    print(f"\nMixtral-shaped model, 4 layers, H={args.hidden}, 8 requests x {new_tokens} new tokens (tok/s):")
    print(f"  transformers generate, sequential: {hf_rate:8.1f}")
    for concurrency, rate in rates.items():
        print(f"  switchyard c={concurrency}:{'':>22}{rate:8.1f}  ({rate / hf_rate:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    args = parser.parse_args()
    args.tokens = [1, 8, 64, 256]
    if args.quick:
        args.hidden, args.intermediate, args.new_tokens, args.repeats, args.tokens = 256, 512, 16, 3, [1, 8, 64]
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_layer(args)
    bench_end_to_end(args)


if __name__ == "__main__":
    main()
