"""This tree's CPU kernels against another tree's, in one process, calls alternating (so that the
host's speed, which moves by 2x within an hour on shared machines, moves both alike).

    git archive REV backends/cpu/csrc | tar -x -C /tmp/base
    python benchmarks/kernel_ab.py --against /tmp/base [--isa avx2] [--kernel block attention]
                                   [--rows 1,2,8,64,256] [--passes 1]

block: the block-format matmul (csrc/block_matmul.cpp) on random weights of the 1.7B shape's
q4_k (8192 x 2048) and q6_k (2048 x 8192), and the default model's q8_0 head (49152 x 576) and
q4_1 (1536 x 576), at each --rows. attention: the paged attention of 500 prompt rows after
1,000 cached positions, laid out as the CPU runner lays a prompt chunk out (each row a decode
row), 64 decode rows of ~1,000 positions, and one of 100 (a chat at c=1), on the 1.7B shape
(32 KV heads, one query head each), SmolLM2-135M's (3 KV heads of 3) and Llama-3-8B's (8 KV
heads of 4, head dim 128).
Both builds are held to --isa (extension.py ISA_LEVELS). Each line: best of the repetitions for
each build, the ratio (base / this: above 1 this tree is faster), and whether the two builds'
outputs are the same bits.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.cpp_extension import load

from switchyard.backends.cpu.extension import BLOCK_SOURCE, LDFLAGS, SOURCE, compile_flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "backends"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def build(source: str, tag: str, isa: str, work: str):
    directory = os.path.join(work, f"{tag}-{isa}-{os.path.basename(source)}")
    os.makedirs(directory, exist_ok=True)
    name = f"sy_ab_{tag}_{isa.replace('-', '_')}_{os.path.splitext(os.path.basename(source))[0]}"
    load(name=name, sources=[source], extra_cflags=list(compile_flags(isa)), extra_ldflags=list(LDFLAGS),
         build_directory=directory, is_python_module=False)
    return getattr(torch.ops, name)


def race(calls: dict, reps: int) -> tuple[dict, dict]:
    best, outs = {tag: float("inf") for tag in calls}, {}
    for _ in range(reps):
        for tag, call in calls.items():
            t = time.perf_counter()
            outs[tag] = call()
            best[tag] = min(best[tag], time.perf_counter() - t)
    return best, outs


def report(label: str, best: dict, outs: dict) -> None:
    same = torch.equal(outs["this"], outs["base"])
    print(f"{label}: this {best['this'] * 1e3:.2f} ms, base {best['base'] * 1e3:.2f} ms, "
          f"base/this {best['base'] / best['this']:.2f}x, same bits: {same}", flush=True)


def block(this, base, args) -> None:
    from switchyard.backends.cpu.block_pack import pack_blocks
    from test_cpu_quant import weight_of

    for fmt, n, k in (("q4_k", 8192, 2048), ("q6_k", 2048, 8192), ("q8_0", 49152, 576), ("q4_1", 1536, 576)):
        w = pack_blocks(weight_of(fmt, n, k, seed=1))
        for rows in args.rows:
            x = torch.randn(rows, k)
            calls = {tag: (lambda ops: lambda: ops.block_mm(x, w.data, w.segments, n, args.passes))(ops)
                     for tag, ops in (("this", this), ("base", base))}
            report(f"{args.isa} block {fmt} {n}x{k}, {rows} rows, {args.passes} pass(es)",
                   *race(calls, max(3, 2000 // rows)))


def attention(this, base, args) -> None:
    block_size, prefix, rows = 16, 1000, 500
    for name, kv_heads, group, head_dim in (("1.7B shape", 32, 1, 64), ("SmolLM2-135M shape", 3, 3, 64),
                                            ("Llama-3-8B shape", 8, 4, 128)):
        blocks = (prefix + rows + block_size - 1) // block_size + 1
        gen = torch.Generator().manual_seed(0)
        cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
        table = torch.randperm(blocks, generator=gen).to(torch.int32)[None].repeat(rows, 1)
        lens = torch.arange(prefix + 1, prefix + rows + 1, dtype=torch.int32)
        query = torch.randn(rows, kv_heads * group, head_dim, generator=gen)

        def call(ops):
            out = torch.empty_like(query)
            ops.paged_decode(out, query, cache, table, lens, 0.125, 0, 0.0)
            return out
        calls = {"this": lambda: call(this), "base": lambda: call(base)}
        report(f"{args.isa} attention, {name}, {rows} prompt rows after {prefix}", *race(calls, 5))
        # decode rows: 64 requests of ~`prefix` positions, each its own blocks (no two attended together)
        decodes = 64
        table = torch.stack([torch.randperm(blocks, generator=gen) for _ in range(decodes)]).to(torch.int32)
        lens = torch.randint(prefix - 50, prefix + 50, (decodes,), generator=gen, dtype=torch.int32)
        query = torch.randn(decodes, kv_heads * group, head_dim, generator=gen)
        report(f"{args.isa} attention, {name}, {decodes} decode rows of ~{prefix}", *race(calls, 20))
        # one request's decode row of 100 positions: a chat at c=1 (one task, one thread)
        table, lens = table[:1], torch.tensor([100], dtype=torch.int32)
        query = torch.randn(1, kv_heads * group, head_dim, generator=gen)
        report(f"{args.isa} attention, {name}, 1 decode row of 100", *race(calls, 2000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="a tree holding backends/cpu/csrc (the base)")
    parser.add_argument("--isa", default="avx512-vnni")
    parser.add_argument("--kernel", nargs="+", default=["block", "attention"], choices=["block", "attention"])
    parser.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 2, 8, 64, 256])
    parser.add_argument("--passes", type=int, default=1, choices=[1, 2])
    parser.add_argument("--work", default="/tmp/switchyard-kernel-ab")
    args = parser.parse_args()
    csrc = os.path.join(args.against, "backends", "cpu", "csrc")
    for kernel, source in (("block", BLOCK_SOURCE), ("attention", SOURCE)):
        if kernel in args.kernel:
            this = build(source, "this", args.isa, args.work)
            base = build(os.path.join(csrc, os.path.basename(source)), "base", args.isa, args.work)
            (block if kernel == "block" else attention)(this, base, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
