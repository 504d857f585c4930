"""Decode attention per layer on this CPU: the gather path vs the in-place C++ kernel.

    python benchmarks/cpu_decode_attention.py [--batches 1 8 32 64] [--context 200] [--repeat 50]

SmolLM2-135M's shapes (9 query heads on 3 KV heads, head_dim 64, block size 16), one
decode token per request against a context of about `--context` tokens (each request
a little different, blocks scattered through a cache of realistic size), float32 and
bfloat16. Times one `CpuAttentionKernel.forward` (one layer; the step plan is rebuilt
per call, as it is once per step in the engine, where 30 layers share it) with the
minimum over `--repeat` alternating calls. The in-place kernel is built (or reused) first into
~/.cache/switchyard, as an engine start would.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from switchyard.backends.cpu.attention import CpuAttentionKernel, StepPlanCache
from switchyard.backends.cpu.extension import PagedDecode
from switchyard.core.backend import AttentionMetadata, AttentionSpec
from switchyard.core.loader.gguf_cache import default_cache_root

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def decode_meta(batch: int, context: int, num_blocks: int, rng: random.Random) -> AttentionMetadata:
    lens = [rng.randint(context - 20, context + 20) for _ in range(batch)]
    needed = [-(-n // BLOCK) for n in lens]
    ids = rng.sample(range(1, num_blocks), sum(needed))
    table = torch.zeros(batch, max(needed), dtype=torch.int32)
    for row, count in enumerate(needed):
        table[row, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    slots = [int(table[r, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for r, n in enumerate(lens)]
    starts = list(range(batch + 1))
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table, slot_mapping=torch.tensor(slots), num_decodes=batch, max_query_len=1,
        max_seq_len=max(lens), query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(lens))


def time_forwards(kernels: list[CpuAttentionKernel], query, cache, meta, repeat: int) -> list[float]:
    """Microseconds of one layer's forward per kernel: calls alternate between the kernels
    (so that a noisy neighbour slows both alike), a fresh plan each call (as per step);
    the minimum over `repeat` calls, the figure least disturbed by other processes."""
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(repeat + 2):
        for kernel, spent in zip(kernels, times):
            kernel._plans = StepPlanCache()
            start = time.perf_counter()
            kernel.forward(query, cache, meta)
            spent.append(time.perf_counter() - start)
    return [min(spent[2:]) * 1e6 for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: torch's); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    in_place = PagedDecode()
    build = in_place.load(default_cache_root())
    if not build.available:
        raise SystemExit(f"the in-place kernel is unavailable: {build.reason}")
    print(f"threads={torch.get_num_threads()} kernel: {'reused' if build.cache_hit else 'compiled'} "
          f"in {build.seconds:.1f} s ({build.directory})")
    print(f"{'dtype':>9} {'batch':>5} {'gather us':>10} {'in-place us':>12} {'speed-up':>9}")
    rng = random.Random(0)
    num_blocks = 64 * (args.context + 40) // BLOCK * 2
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
            spec = AttentionSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                                 scale=HEAD_DIM ** -0.5, dtype=dtype)
            for batch in args.batches:
                meta = decode_meta(batch, args.context, num_blocks, rng)
                query = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
                gather, fast = time_forwards([CpuAttentionKernel(spec), CpuAttentionKernel(spec, decode=in_place)],
                                             query, cache, meta, args.repeat)
                print(f"{str(dtype).split('.')[1]:>9} {batch:>5} {gather:>10.0f} {fast:>12.0f} {gather / fast:>8.2f}x")


if __name__ == "__main__":
    main()
