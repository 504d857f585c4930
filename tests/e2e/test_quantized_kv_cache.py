"""The default model on the path `switchyard serve` takes by default (the packed GGUF, integer
kernels, every step in C++), with a quantized KV cache (--kv-cache-dtype int8, fp8_e4m3fn,
fp8_e5m2: the C++ layers write each head's k and v as one-byte codes and a scale, and attend over
the codes):
- the README's question gets the float cache's greedy answer, token for token;
- batch invariance holds as with the float cache: a request's greedy tokens and log-probabilities,
  prompt log-probabilities included, are the same bits alone or beside other requests, and
  whether its prompt is computed whole or in chunks of 16 tokens (each row is quantized on its
  own, and each decode row attends alone);
- speculation's verify steps (decode rows through the same kernels) give plain greedy decoding's
  tokens."""
from __future__ import annotations

import pytest

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.loader import load_tokenizer
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.text.chat_template import render_chat

pytestmark = pytest.mark.slow

FORMATS = ["int8", "fp8_e4m3fn", "fp8_e5m2"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = ("The river bends twice before it reaches the old mill, where the water slows and the "
          "children of the village come to fish in summer. In winter the ice is thick enough")
OTHERS = ["Write a short poem about the sea.", "List three colours of the rainbow:",
          "Once upon a time, in a small town by the mountains,"]


def _engine(kv_cache_dtype: str, budget: int = 2048, speculate: int = 0) -> EngineCore:
    config = EngineConfig(model=ModelConfig(dtype="auto"), compile_decode=True,
                          cache=CacheConfig(num_blocks=256, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                          speculative=SpeculativeConfig(num_speculative_tokens=speculate, adaptive=False))
    return EngineCore(config, tokenizer=load_tokenizer(config.model))


def _run(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list]:
    """Every output of each request (tokens, logprobs, top logprobs, prompt logprobs)."""
    try:
        for request_id, ids in prompts.items():
            engine.add_request(Request(request_id, ids, params))
        seen = {request_id: [] for request_id in prompts}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append((out.new_token_ids, out.logprobs, out.top_logprobs, out.prompt_logprobs))
        return seen
    finally:
        engine.shutdown()


def _tokens(outputs: list) -> list[int]:
    return [token for new, *_ in outputs for token in new]


def _question_ids() -> list[int]:
    """The README's question as the server renders it: the chat template, then the tokenizer."""
    tokenizer = load_tokenizer(ModelConfig())
    return tokenizer.encode(render_chat(tokenizer, QUESTION), add_special_tokens=False)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_the_readmes_question_gets_the_float_caches_answer(kv_cache_dtype):
    params = SamplingParams(temperature=0.0, max_tokens=32)
    ids = {"q": _question_ids()}
    quantized, floats = _run(_engine(kv_cache_dtype), ids, params), _run(_engine("auto"), ids, params)
    assert _tokens(quantized["q"]) == _tokens(floats["q"])
    tokenizer = load_tokenizer(ModelConfig())
    assert "Paris" in tokenizer.decode(_tokens(quantized["q"]))


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_a_request_is_the_same_bits_alone_batched_and_chunked(kv_cache_dtype):
    tokenizer = load_tokenizer(ModelConfig())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    mine = {"r": tokenizer.encode(PROMPT)}
    alone = _run(_engine(kv_cache_dtype), mine, params)["r"]
    batched = _run(_engine(kv_cache_dtype), {**mine, **{f"o{i}": tokenizer.encode(text)
                                                        for i, text in enumerate(OTHERS)}}, params)["r"]
    chunked = _run(_engine(kv_cache_dtype, budget=16), mine, params)["r"]
    assert len(alone) == 12 and alone[0][3] is not None  # one output a token; the prompt's logprobs first
    assert batched == alone and chunked == alone


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3fn"])
def test_speculative_verify_steps_keep_greedy_tokens(kv_cache_dtype):
    """n-gram proposals over a repetitive prompt, verified as decode rows over the quantized cache."""
    tokenizer = load_tokenizer(ModelConfig())
    text = "one two three four five six seven eight nine ten. " * 4 + "one two three"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = {"r": tokenizer.encode(text)}
    plain = _run(_engine(kv_cache_dtype), ids, params)
    engine = _engine(kv_cache_dtype, speculate=3)
    stats = engine.scheduler.speculator.stats
    speculated = _run(engine, ids, params)
    assert stats.num_verify_steps > 0 and stats.num_accepted > 0
    assert _tokens(speculated["r"]) == _tokens(plain["r"])
