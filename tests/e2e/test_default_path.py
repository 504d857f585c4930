"""The default model on the path `switchyard serve` takes by default (the packed GGUF, integer
kernels, every step in C++): a request's tokens and log-probabilities, prompt log-probabilities
included, are the same bits whether its prompt is computed whole or in chunks of 16 tokens, on
every instruction-set level this CPU runs but the portable one (tests/gateway/test_isa_paths.py
serves the README's question there)."""
from __future__ import annotations

import pytest

from switchyard.backends.cpu.extension import isa_levels
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.loader import load_tokenizer
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request

pytestmark = pytest.mark.slow

PROMPT = ("The river bends twice before it reaches the old mill, where the water slows and the "
          "children of the village come to fish in summer. In winter the ice is thick enough")


def _run(isa: str, budget: int) -> list:
    config = EngineConfig(model=ModelConfig(dtype="auto"), cache=CacheConfig(num_blocks=256), compile_decode=True,
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget), isa=isa)
    tokenizer = load_tokenizer(config.model)
    engine = EngineCore(config, tokenizer=tokenizer)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=3)
        engine.add_request(Request("r", tokenizer.encode(PROMPT), params))
        seen = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen.append((out.new_token_ids, out.logprobs, out.top_logprobs, out.prompt_logprobs))
        return seen
    finally:
        engine.shutdown()


@pytest.mark.parametrize("isa", [level for level in isa_levels() if level != "portable"])
def test_chunked_prefill_equals_whole_prefill_to_the_bit(isa):
    whole, chunked = _run(isa, 2048), _run(isa, 16)
    assert len(whole) == 12 and whole[0][3] is not None  # one output a token; the prompt's logprobs first
    assert chunked == whole
