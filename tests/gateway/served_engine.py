"""The default model's engine as the gateway tests serve it (conftest.py's session engine, and
test_isa_paths.py's one per instruction-set level)."""
from __future__ import annotations

import asyncio
import time

from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def default_engine_config(isa: str = "auto", max_num_batched_tokens: int = 1024) -> EngineConfig:
    """The default model as `switchyard serve` serves it by default (the packed GGUF, `--dtype
    auto`, every step in C++), at instruction-set level `isa`, with the tests' caps on memory."""
    return EngineConfig(model=ModelConfig(dtype="auto"), cache=CacheConfig(num_blocks=2048), compile_decode=True,
                        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64),
                        isa=isa)


def start_engine(config: EngineConfig) -> InProcessEngineClient:
    """An in-process engine of `config`, started and ready (call `stop_engine` after)."""
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.loader import load_tokenizer

    def factory():
        tokenizer = load_tokenizer(config.model)
        return EngineCore(config, tokenizer=tokenizer), tokenizer

    client = InProcessEngineClient(factory)
    client.start()
    deadline = time.monotonic() + 600
    while not client.ready:
        if client.startup_error is not None:
            raise client.startup_error
        assert time.monotonic() < deadline, "engine did not start"
        time.sleep(0.05)
    return client


def stop_engine(client: InProcessEngineClient) -> None:
    asyncio.run(client.shutdown())
