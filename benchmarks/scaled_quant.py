"""One weight's matmul in the scaled-code formats (core/quant/scaled.py) against the same weight
in bf16 (oneDNN-packed where this CPU packs bf16, as the CPU backend multiplies float weights),
at a few row counts: the fp8 kernel (csrc/fp8_matmul.cpp), fp8's batch path (fp8_dequantize +
bf16 matmul), and bitsandbytes' own ops (nf4 / fp4 gemv_4bit, dequantize_4bit + bf16, LLM.int8).

    python benchmarks/scaled_quant.py [--shape 2048 2048] [--rows 1 4 16 32] [--threads 1]

Best of --repeat calls each (the machine may be shared: the best is the least disturbed).
"""
from __future__ import annotations

import argparse
import time

import torch


def best_ms(fn, repeat: int) -> float:
    fn(), fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=(2048, 2048), metavar=("OUT", "IN"))
    parser.add_argument("--rows", type=int, nargs="+", default=(1, 4, 16, 32))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from switchyard.backends.cpu.bnb_linear import bnb_kernel, import_bnb
    from switchyard.backends.cpu.fp8_linear import Fp8Linear, load_fp8_kernel
    from switchyard.backends.cpu.linear import PackedLinear, packable_dtypes
    from switchyard.core.loader.gguf_cache import default_cache_root
    from switchyard.core.quant.weight import quantize_bnb, quantize_fp8

    out, inp = args.shape
    weight = torch.randn(out, inp) * 0.02
    bf16 = weight.to(torch.bfloat16)
    dense = PackedLinear(bf16, None) if torch.bfloat16 in packable_dtypes() else None
    fp8_ops = load_fp8_kernel(default_cache_root()).ops
    fp8 = Fp8Linear(quantize_fp8(weight), fp8_ops, None, None)
    kernels = {}
    if import_bnb() is not None:
        for fmt in ("bnb_nf4", "bnb_fp4", "bnb_int8"):
            kernels[fmt] = bnb_kernel(quantize_bnb(weight, fmt), None, None)
        kernels["bnb_nf4 dequantize+bf16"] = bnb_kernel(quantize_bnb(weight, "bnb_nf4"), None, 0)
    print(f"{out}x{inp}, {args.threads} thread(s), best of {args.repeat} (ms)")
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, inp, dtype=torch.bfloat16)
            line = {"bf16": best_ms(lambda: dense(x) if dense is not None else torch.nn.functional.linear(x, bf16),
                                    args.repeat)}
            if fp8_ops is not None:
                line["fp8 kernel"] = best_ms(lambda: fp8.multiply(x), args.repeat)
                line["fp8 dequantize+bf16"] = best_ms(lambda: fp8.multiply_batch(x), args.repeat)
            for name, module in kernels.items():
                line[name] = best_ms(lambda: module(x), args.repeat)
            print(f"rows {rows:3d}: " + ", ".join(f"{k} {v:.3f}" for k, v in line.items()))


if __name__ == "__main__":
    main()
