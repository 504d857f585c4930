"""Shared by the xla environment's tests: the engine runs and the compile counter."""
from __future__ import annotations

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request


def compiles() -> int:
    """Graphs torch_xla has compiled in this process so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


def tiny_config(max_num_seqs: int = 4, max_num_batched_tokens: int = 32, block_size: int = 8) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", seed=3, max_model_len=96),
                        cache=CacheConfig(block_size=block_size, num_blocks=64),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens))


def generate(engine: EngineCore, prompts: list[list[int]], max_tokens: int, prefix: str = "r") -> dict[str, list[int]]:
    """Greedy tokens of every prompt, all submitted at once, stepped to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {f"{prefix}{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"{prefix}{i}", list(prompt), params))
    while engine.has_unfinished_requests():
        for output in engine.step():
            out[output.request_id].extend(output.new_token_ids)
    return out
