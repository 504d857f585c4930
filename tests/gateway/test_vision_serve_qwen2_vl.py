"""Qwen2-VL served: a tiny random-weight checkpoint behind the real gateway. The OpenAI SDK's image
part goes through the chat template (`<|vision_start|><|image_pad|><|vision_end|>`), TGI's
markdown image becomes the same placeholder (EngineInfo.image_token); both answer as
transformers' generate does on the same prompt."""
from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import httpx
import pytest
import torch

from served_engine import start_engine, stop_engine
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.testing.serving import serve_on_loop
from switchyard.core.testing.tiny_qwen2_vl import processor_inputs, tiny_qwen2_vl
from switchyard.core.testing.tiny_vlm import png_bytes
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings

MODEL = "tiny-qwen2-vl"
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-vl")
    hf, tokenizer, image_processor = tiny_qwen2_vl(path)
    return path, hf, tokenizer, image_processor


@pytest.fixture(scope="module")
def base_url(checkpoint):
    config = EngineConfig(model=ModelConfig(model=str(checkpoint[0])), cache=CacheConfig(num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512), compile_decode=True)
    engine = start_engine(config)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    app = create_app(ServerSettings(model_id=MODEL), engine)
    server, url = serve_on_loop(app, loop)
    yield url
    server.should_exit = True
    time.sleep(0.3)
    stop_engine(engine)


def hf_answer(checkpoint, text: str, pictures: list[bytes]) -> str:
    from PIL import Image

    _, hf, tokenizer, image_processor = checkpoint
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pictures]
    inputs = processor_inputs(tokenizer, image_processor, text, images)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def test_openai_sdk_and_tgi_answer_as_transformers(base_url, checkpoint):
    from openai import OpenAI

    tokenizer = checkpoint[2]
    first, second = png_bytes(112, 56, seed=1), png_bytes(30, 90, seed=2)
    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, max_tokens=NUM_TOKENS, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(first)}},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": data_url(second)}},
                                     {"type": "text", "text": "describe them"}]}])
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
             {"type": "text", "text": "describe them"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    assert reply.usage.completion_tokens == NUM_TOKENS
    assert reply.choices[0].message.content == hf_answer(checkpoint, text, [first, second])
    tgi = httpx.post(base_url + "/generate", timeout=60, json={
        "inputs": f"![]({data_url(first)})what is this?",
        "parameters": {"max_new_tokens": NUM_TOKENS, "do_sample": False}})
    assert tgi.status_code == 200, tgi.text
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert tgi.json()["generated_text"] == hf_answer(checkpoint, placeholder + "what is this?", [first])
