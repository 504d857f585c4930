"""What the engine itself answers, bypassing HTTP: the reference the OpenAI-dialect
tests compare the server's answers with."""
from __future__ import annotations

import asyncio
import functools
import uuid
from dataclasses import dataclass

from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.gateway.openai.common import openai_finish_reason

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Generated:
    prompt_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


@functools.lru_cache(maxsize=1)
def reference_tokenizer():
    """The default model's transformers tokenizer: chat prompts rendered by transformers itself."""
    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_hf_tokenizer

    return load_hf_tokenizer(ModelConfig())


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    tokenizer = reference_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def generate(server, prompt_ids: list[int], **params) -> Generated:
    """Run one request on the server's engine client directly."""

    async def run() -> Generated:
        stream = await server.client.add_request(Request(uuid.uuid4().hex, list(prompt_ids),
                                                         SamplingParams(**params)))
        pieces, ids, reason = [], [], None
        async for out in stream:
            pieces.append(out.new_text)
            ids.extend(out.new_token_ids)
            reason = out.finish_reason
        return Generated(list(prompt_ids), "".join(pieces), ids, openai_finish_reason(reason))

    return asyncio.run(run())


def greedy_chat(server, messages: list[dict], max_tokens: int) -> Generated:
    ids = chat_prompt_ids(messages)
    return generate(server, ids, temperature=0.0, max_tokens=max_tokens)


def greedy_completion(server, prompt: str, max_tokens: int) -> Generated:
    return generate(server, server.client.tokenizer.encode(prompt), temperature=0.0, max_tokens=max_tokens)
