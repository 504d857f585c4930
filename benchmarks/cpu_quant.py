"""Decode step time of the default model with quantized weights on the CPU, against float.

    python benchmarks/cpu_quant.py [--concurrency 1 32] [--rounds 3] [--profile] [--dtype D]

One EngineCore per weight format (--quantize gguf: the file's own Q4_1/Q8_0 blocks; int4 /
int8: made at load from the file's dequantized weights; none: the file dequantized, oneDNN-packed), all in
--dtype (default auto: what `switchyard serve` picks here, bf16 on AVX512-BF16/AMX CPUs,
float32 elsewhere). For each concurrency the formats alternate round by round (gguf, int4, int8, float,
gguf, ...) so a noisy neighbour disturbs them alike; a figure is the median decode-only step
of a round (benchmarks/cpu_decode_step.py), and the best round is kept. Ratios are against
the float weights. --profile: torch.profiler's top ops of decode steps at concurrency 1 with gguf.
--forward: instead of engine steps, the model's forward + logits of one decode step alone
(no scheduler or sampling; min over rounds of the mean of 5 calls), steadier on a busy machine.
--kernels: no model; every linear of --shape's layers once (the default model's 30, or
SmolLM2-1.7B's 24), in --format (random valid blocks), through the block kernel with two
activation passes (the default) and with one (and torch's int4 kernel for q4_0/q4_1, and the
same shapes in bf16 packed by oneDNN for the default model's), for each --concurrency as the
number of rows (best of 10 passes), with the block kernel's rate of reading the weights.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from cpu_decode_step import decode_step_ms

from switchyard.backends.cpu import CpuBackend
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request

FORMATS = ("gguf", "int4", "int8", "none")  # none: the GGUF dequantized, oneDNN-packed float


def engine(quantize: str | None, concurrency: int, dtype: str) -> EngineCore:
    config = EngineConfig(model=ModelConfig(dtype=dtype, quantize=quantize), cache=CacheConfig(num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=max(concurrency, 1), max_num_batched_tokens=8192))
    return EngineCore(config, backend=CpuBackend())


def forward_ms(core: EngineCore, concurrency: int, context: int, reps: int = 5) -> float:
    """Mean ms of the model's forward + logits of one decode step of `concurrency` requests."""
    from switchyard.core.testing.batches import make_meta

    model = core.loaded.model
    blocks = -(-context // 16) * concurrency + 2
    meta = make_meta([(1, context)] * concurrency, concurrency, 16, blocks, random.Random(0), torch.device("cpu"))
    spec = core.loaded.attention_spec
    kv = core.backend.allocate_kv_cache(core.loaded.num_layers, blocks, spec)
    ids, positions = torch.full((concurrency,), 1000), torch.full((concurrency,), context - 1)
    with torch.inference_mode():
        model.compute_logits(model(ids, positions, kv, meta))
        start = time.perf_counter()
        for _ in range(reps):
            model.compute_logits(model(ids, positions, kv, meta))
    return (time.perf_counter() - start) / reps * 1e3


SHAPES = {"smollm2-135m": ((960, 576), (576, 576), (3072, 576), (576, 1536), 30),
          "smollm2-1.7b": ((6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), 24)}


def kernel_ms(rows_list: list[int], fmt: str = "q4_1", shape: str = "smollm2-135m", isa: str = "auto") -> None:
    """Prints the --kernels table (see the module docstring)."""
    from switchyard.backends.cpu.linear import PackedLinear
    from switchyard.backends.cpu.quant import BlockLinear, Int4Linear, load_block_kernel
    from switchyard.core.loader.gguf_cache import default_cache_root
    from switchyard.core.quant import BLOCK_WEIGHTS
    from switchyard.core.testing.quant_blocks import random_blocks

    ops = load_block_kernel(default_cache_root(), isa=isa).ops
    *shapes, layers = SHAPES[shape]
    weights = [[random_blocks(fmt, out, inp // BLOCK_WEIGHTS[fmt], seed, (1e-4, 1e-3)) for out, inp in shapes]
               for seed in range(layers)]
    nbytes = sum(w.nbytes for layer in weights for w in layer)
    with torch.inference_mode():
        kinds = {"block int8x2": [BlockLinear(w, ops) for layer in weights for w in layer],
                 "block int8": [BlockLinear(w, ops, None, 1) for layer in weights for w in layer]}
        if fmt in ("q4_0", "q4_1"):
            kinds["torch int4"] = [Int4Linear(w) for layer in weights for w in layer]
        if shape == "smollm2-135m":
            kinds["bf16 oneDNN"] = [PackedLinear(w.dequantize(torch.bfloat16), None) for layer in weights for w in layer]
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in shapes}
            figures = []
            for name, modules in kinds.items():
                best = float("inf")
                for _ in range(10):
                    start = time.perf_counter()
                    for module in modules:
                        module(inputs[module.in_features])
                    best = min(best, time.perf_counter() - start)
                rate = f" ({nbytes / best / 1e9:.1f} GB/s of {fmt})" if name.startswith("block") else ""
                figures.append(f"{name} {best * 1e3:.2f} ms{rate}")
            print(f"{shape} {fmt}, {rows:>3} rows: " + ", ".join(figures))


def profile(core: EngineCore, steps: int = 20) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    core.add_request(Request("profile", [random.randrange(1000, 40000) for _ in range(180)], params))
    for _ in range(4):  # prefill and warm decodes
        core.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    while core.has_unfinished_requests():
        core.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=180)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--forward", action="store_true", help="time the model's forward alone")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kernels", action="store_true", help="time the linear kernels alone")
    parser.add_argument("--format", default="q4_1", help="--kernels: the block format (q4_0 ... q6_k)")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="--kernels: the layer shapes")
    parser.add_argument("--cpu-isa", default="auto", help="--kernels: the block kernel's build (auto, avx2, portable ...)")
    args = parser.parse_args()
    if args.kernels:
        kernel_ms(args.concurrency, args.format, args.shape, args.cpu_isa)
        return
    print(f"threads={torch.get_num_threads()} context~{args.prompt_tokens}+{args.new_tokens}")
    rng = random.Random(0)
    for concurrency in args.concurrency:
        engines = {q: engine(q, concurrency, args.dtype) for q in FORMATS}
        step_args = argparse.Namespace(concurrency=concurrency, prompt_tokens=args.prompt_tokens,
                                       new_tokens=args.new_tokens)
        results = {q: [] for q in FORMATS}
        for _ in range(args.rounds):
            for q, core in engines.items():
                results[q].append(forward_ms(core, concurrency, args.prompt_tokens) if args.forward
                                  else decode_step_ms(core, concurrency, step_args, rng))
        base = min(results["none"])
        for q, figures in results.items():
            rounds = ", ".join(f"{f:.1f}" for f in figures)
            print(f"c={concurrency:<3} {q:>5}: {min(figures):6.1f} ms/step, "
                  f"float / this {base / min(figures):.2f}"
                  f" (rounds: {rounds})")
        if args.profile and concurrency == 1:
            profile(engines["gguf"])
        del engines


if __name__ == "__main__":
    main()
