"""The LoRA deltas of one decoder layer of the default model (SmolLM2-135M: hidden 576, 3 of 9
heads for K and V, intermediate 1536) against that layer's base linears, on the CPU: the C++
kernel (backends/cpu/lora.py, csrc/lora.cpp) and the plain-torch reference (core/lora/kernel.py
TorchLoraKernel), a shrink and an expand for each of the 7 projections (q, k, v, o, gate, up, down;
q/k/v and gate/up expanded into column slices of their fused outputs, as the engine's are), 8
resident adapters of rank 16.

    python benchmarks/lora_kernel.py [--tokens 1 8 32 256] [--dtype float32 bfloat16] [--threads 2]

Layouts: "decode", one token a request, the slots cycling over the 8 adapters (every run one
token); "prefill", runs of 32 tokens with one adapter. The base is the layer's 4 linears (qkv,
o, gate_up, down) as the CPU backend multiplies them (oneDNN-packed where this torch packs the
dtype). Best of --repeat, the three called in turn each round (the machine may be shared: the best
is the least disturbed).

2-core AMD EPYC (Zen 4, AVX-512 VNNI and BF16; shared with other jobs, load 2.3), one thread,
2026-12-06, ms per layer (base / C++ / torch, then C++ and torch over base):

    rank 16    float32                               bfloat16
    T=1        0.596  0.080  0.202   0.14  0.34      0.242  0.072  0.262   0.30  1.08
    T=8        1.028  0.246  1.270   0.24  1.24      0.452  0.205  1.733   0.45  3.83
    T=32       2.619  0.492  5.006   0.19  1.91      1.390  0.442  6.771   0.32  4.87
    T=256      16.95  2.090  38.81   0.12  2.29      8.867  2.532  53.91   0.29  6.08
    prefill    16.86  2.161  3.624   0.13  0.21      8.555  2.395  4.213   0.28  0.49

At one token the C++ time is mostly its 14 op calls (about 2.5 us to call one from Python). With
stacks of rank 64 (the engine's default --max-lora-rank: an adapter of rank 16 padded with zeros)
every figure is about 4x the work, and 8 adapters' stacks of one layer (21 MB in float32) no longer
stay in cache: C++ over base 0.19 / 1.45 / 1.04 / 0.42 / 0.42 in float32, 0.34 / 0.97 / 1.15 /
0.93 / 0.97 in bfloat16 (torch: 0.3-9x).
"""
from __future__ import annotations

import argparse
import time

import torch

HIDDEN, KV, INTER = 576, 192, 1536
# (in, out, column offset in the fused output, fused width)
QKV = HIDDEN + 2 * KV
TARGETS = {"q": (HIDDEN, HIDDEN, 0, QKV), "k": (HIDDEN, KV, HIDDEN, QKV), "v": (HIDDEN, KV, HIDDEN + KV, QKV),
           "o": (HIDDEN, HIDDEN, 0, HIDDEN), "gate": (HIDDEN, INTER, 0, 2 * INTER),
           "up": (HIDDEN, INTER, INTER, 2 * INTER), "down": (INTER, HIDDEN, 0, HIDDEN)}
BASE = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN)}


def best_ms(fns: dict, repeat: int) -> dict[str, float]:
    """Each function's best time, the functions called in turn each round (a shared machine's load
    falls on all of them alike)."""
    for fn in fns.values():
        fn(), fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def batch_of(tokens: int, layout: str, adapters: int):
    from switchyard.core.testing.lora_batches import lora_batch

    if layout == "decode":
        return lora_batch([(1, t % adapters) for t in range(tokens)])
    return lora_batch([(min(32, tokens - start), (start // 32) % adapters) for start in range(0, tokens, 32)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=(1, 8, 32, 256))
    parser.add_argument("--dtype", nargs="+", default=("float32", "bfloat16"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from switchyard.backends.cpu.linear import PackedLinear, packable_dtypes
    from switchyard.backends.cpu.lora import CpuLoraKernel
    from switchyard.core.loader.gguf_cache import default_cache_root
    from switchyard.core.lora.kernel import TorchLoraKernel

    cpp = CpuLoraKernel.load(default_cache_root())
    kernels = {"C++": cpp, "torch": TorchLoraKernel()}
    print(f"{torch.get_num_threads()} thread(s), rank {args.rank}, {args.adapters} adapters, best of {args.repeat} "
          f"(ms per layer: 7 shrinks + 7 expands; base: the layer's 4 linears); C++ kernel: {cpp.path}")
    print(f"{'dtype':9} {'T':>4} {'layout':8} {'base':>7} {'C++':>7} {'torch':>7} {'C++/base':>9} {'torch/base':>10}")
    for name in args.dtype:
        dtype = getattr(torch, name)
        gen = torch.Generator().manual_seed(0)
        stacks = {t: ((torch.randn(args.adapters, args.rank, i, generator=gen) / i ** 0.5).to(dtype),
                      (torch.randn(args.adapters, o, args.rank, generator=gen) / args.rank ** 0.5).to(dtype))
                  for t, (i, o, _, _) in TARGETS.items()}
        scales = torch.full((args.adapters,), 2.0)
        weights = {b: (torch.randn(o, i, generator=gen) * 0.02).to(dtype) for b, (i, o) in BASE.items()}
        packed = dtype in packable_dtypes()
        base = {b: PackedLinear(w, None) if packed else (lambda x, w=w: torch.nn.functional.linear(x, w))
                for b, w in weights.items()}
        for tokens in args.tokens:
            for layout in ("decode", "prefill") if tokens > 32 else ("decode",):
                batch = batch_of(tokens, layout, args.adapters)
                x = {HIDDEN: torch.randn(tokens, HIDDEN, generator=gen).to(dtype),
                     INTER: torch.randn(tokens, INTER, generator=gen).to(dtype)}
                outs = {width: torch.zeros(tokens, width, dtype=dtype)
                        for width in {fused for _, _, _, fused in TARGETS.values()}}

                def layer(kernel):
                    for target, (i, o, offset, fused) in TARGETS.items():
                        a, b = stacks[target]
                        h = kernel.shrink(x[i], a, batch)
                        kernel.expand(outs[fused][:, offset:offset + o], h, b, scales, batch)

                def base_layer():
                    for b, (i, _) in BASE.items():
                        base[b](x[i])

                with torch.inference_mode():
                    times = best_ms({"base": base_layer, **{k: lambda k=k: layer(kernels[k]) for k in kernels}},
                                    args.repeat)
                base_ms = times["base"]
                print(f"{name:9} {tokens:4} {layout:8} {base_ms:7.3f} {times['C++']:7.3f} {times['torch']:7.3f} "
                      f"{times['C++'] / base_ms:9.2f} {times['torch'] / base_ms:10.2f}")


if __name__ == "__main__":
    main()
