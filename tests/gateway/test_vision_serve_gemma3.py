"""Gemma 3's vision-language model served (core/models/gemma3_vision.py): a tiny random-weight
checkpoint behind the real gateway, driven by the OpenAI SDK; the prompt's length and the answer's
log-probabilities are transformers' for the same chat (its random tokens are bytes that need not
decode to text, so the text is not compared)."""
from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import pytest
import torch

from served_engine import start_engine, stop_engine
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.testing.serving import serve_on_loop
from switchyard.core.testing.tiny_gemma3_vl import tiny_gemma3_vl
from switchyard.core.testing.tiny_vlm import hf_greedy_scored, png_bytes
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings

MODEL = "tiny-gemma3"
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL of a uvicorn app over an in-process engine, hf model, processor)."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    hf, processor = tiny_gemma3_vl(path)
    engine = start_engine(EngineConfig(model=ModelConfig(model=str(path)), cache=CacheConfig(num_blocks=64),
                                       scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, url = serve_on_loop(create_app(ServerSettings(model_id=MODEL), engine), loop)
    yield url, hf, processor
    server.should_exit = True
    time.sleep(0.3)
    stop_engine(engine)


def hf_answer(hf, processor, content: list[dict], pictures: list[bytes]) -> tuple[int, list[float]]:
    """transformers' (prompt length, greedy tokens' log-probabilities) for one user turn."""
    from PIL import Image

    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(p)).convert("RGB") for p in pictures],
                       return_tensors="pt")
    return inputs["input_ids"].shape[1], hf_greedy_scored(hf, inputs, NUM_TOKENS)[1]


def test_openai_sdk_gets_transformers_answer_for_two_images(served):
    from openai import OpenAI

    base, hf, processor = served
    pictures = [png_bytes(50, 40, seed=1), png_bytes(30, 60, seed=2)]
    urls = [f"data:image/png;base64,{base64.b64encode(p).decode()}" for p in pictures]
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, max_tokens=NUM_TOKENS, temperature=0, logprobs=True, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": urls[0]}},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": urls[1]}},
                                     {"type": "text", "text": "compare them"}]}])
    length, logprobs = hf_answer(hf, processor, [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                               {"type": "text", "text": "compare them"}], pictures)
    assert reply.usage.prompt_tokens == length
    assert reply.usage.completion_tokens == NUM_TOKENS
    served_logprobs = [entry.logprob for entry in reply.choices[0].logprobs.content]
    torch.testing.assert_close(torch.tensor(served_logprobs), torch.tensor(logprobs), atol=2e-4, rtol=0)
