"""Decode steps of the default model with LoRA on and off, through the engine as `switchyard serve`
runs it (compile_decode: the CPU's fused C++ layers), on the CPU.

    python benchmarks/lora_steps.py [--rank 16] [--requests 4] [--rounds 6]

One PEFT adapter of rank --rank on every projection (q, k, v, o, gate, up, down) of every layer,
made by peft over the model's shapes (random matrices: the timing does not depend on them), 8
slots. Four engines' steps, called in turn each round, best of --rounds (the machine may be
shared): LoRA off (the fused C++ layers); LoRA off with compile_decode off (the model's layers, what
an adapter step ran before the C++ layers applied the deltas); LoRA on with base-model requests only (the C++ layers: the wrappers
are not called); LoRA on with every request on the adapter (the C++ layers plus the deltas, the CPU's LoRA
kernel).

2-core AMD EPYC (Zen 4, AVX-512 VNNI), idle (load 0.35), 2026-12-06, the default model (GGUF,
float32), 4 requests, ms per decode step:

    rank 16    LoRA off 9.8   model's layers 16.5   LoRA on, base 10.0   LoRA on, adapter 13.3
    (night, idle, after the fused path's per-call tensors went and the stacks were prefetched:)
    rank 16    LoRA off 10.5  model's layers 17.4   LoRA on, base 10.5   LoRA on, adapter 12.6

Adapter rows run in the fused C++ layers too (csrc/decode_layers.cpp applies the deltas after
each linear with csrc/lora.h, the kernel the wrappers call): their deltas cost about 2.1 ms a
step (3.3 before; per layer one shrink for q/k/v, one for gate/up, one each for o and down, and 7 expands);
base requests keep the C++ layers' speed. Before the C++ layers applied them, adapter steps ran
the model's layers: 23.2 ms.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from switchyard.core.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.testing.lora_adapters import default_model_adapter

PROMPT = [1, 4093, 314, 253, 1345, 28, 6357, 30, 27, 3160]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: str, rank: int) -> None:
    """PEFT's adapter over the default model's shapes, on every projection."""
    default_model_adapter(path, rank, PROJECTIONS, scale=0.02)


def make_adapters(root: str, count: int, rank: int) -> list[tuple[str, str]]:
    """`count` such adapters under root, as (name, path): a0, a1, ..."""
    adapters = []
    for i in range(count):
        path = os.path.join(root, f"a{i}")
        make_adapter(path, rank)
        adapters.append((f"a{i}", path))
    return adapters


def engine(lora: LoraConfig, compile_decode: bool = True) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(), cache=CacheConfig(num_blocks=64), backend="cpu",
                                   compile_decode=compile_decode, lora=lora))


def decode_ms(core: EngineCore, adapter: str | None, tag: str, requests: int) -> float:
    """ms per decode step of `requests` requests (after their prompt's step)."""
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    for i in range(requests):
        core.add_request(Request(f"{tag}-{i}", PROMPT, params, lora_name=adapter))
    core.step()
    start, steps = time.perf_counter(), 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    directory = tempfile.mkdtemp()
    make_adapter(f"{directory}/a", args.rank)
    on = engine(LoraConfig(adapters=(("a", f"{directory}/a"),), max_loras=8, max_lora_rank=args.rank))
    cases = {"LoRA off": (engine(LoraConfig()), None),
             "model's layers": (engine(LoraConfig(), compile_decode=False), None),
             "LoRA on, base": (on, None), "LoRA on, adapter": (on, "a")}
    best = {name: float("inf") for name in cases}
    for round_ in range(args.rounds):
        for name, (core, adapter) in cases.items():
            best[name] = min(best[name], decode_ms(core, adapter, f"{round_}-{name}", args.requests))
    print(f"rank {args.rank}, {args.requests} requests: " + "   ".join(f"{n} {ms:.1f}" for n, ms in best.items()))


if __name__ == "__main__":
    main()
