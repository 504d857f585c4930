"""A base model without a chat template: chat routes answer a clear 400 (TGI's 422 on
/chat_tokenize) while /v1/completions and /generate work; `--chat-template FILE`
(serve) / `ModelConfig.chat_template` / `LLM(chat_template=...)` give it one. The
model is llama-tiny with random weights and a byte-level tokenizer that has no template."""
from __future__ import annotations

import contextlib
import time

import pytest
from fastapi.testclient import TestClient

from switchyard.core.text.chat_template import ChatTemplateError, read_chat_template
from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.llm import LLM
from switchyard.core.params import SamplingParams
from switchyard.gateway.app import create_app
from switchyard.gateway.cli import build_parser
from switchyard.gateway.serve import engine_config
from switchyard.gateway.settings import ServerSettings

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


def _tiny(chat_template: str | None = None) -> ModelConfig:
    return ModelConfig(model="llama-tiny", load_format="dummy", max_model_len=256, chat_template=chat_template)


def _app(model: ModelConfig) -> TestClient:
    def factory():
        from switchyard.core.engine.core import EngineCore
        from switchyard.core.loader import load_tokenizer

        config = EngineConfig(model=model, cache=CacheConfig(num_blocks=64),
                              scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
        tokenizer = load_tokenizer(config.model)
        return EngineCore(config, tokenizer=tokenizer), tokenizer

    return TestClient(create_app(ServerSettings(model_id="llama-tiny"), InProcessEngineClient(factory)))


@contextlib.contextmanager
def _serving(model: ModelConfig):
    """The app with its engine started (the lifespan starts it; wait until it is ready)."""
    with _app(model) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.05)
        yield client


@pytest.fixture(scope="module")
def base_model():
    with _serving(_tiny()) as client:
        yield client


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def test_chat_without_a_template_is_a_clear_400_and_prompts_still_work(base_model):
    chat = base_model.post("/v1/chat/completions", json={"model": "llama-tiny", "messages": MESSAGES,
                                                          "max_tokens": 4})
    assert chat.status_code == 400, chat.text
    error = chat.json()["error"]
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    assert error["param"] == "messages"
    assert base_model.post("/v1/responses", json={"input": "hi"}).status_code == 400
    assert base_model.post("/chat_tokenize", json={"messages": MESSAGES}).status_code == 422

    completion = base_model.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
    generated = base_model.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}})
    assert generated.status_code == 200 and "generated_text" in generated.json()


def test_a_chat_template_file_makes_chat_work(template_file):
    with _serving(_tiny(template_file)) as client:
        answer = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3,
                                                           "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
        rendered = client.post("/chat_tokenize", json={"messages": MESSAGES}).json()["templated_text"]
        assert rendered == "<user>hi\n<assistant>"


def test_serve_flag_reaches_the_model_config(template_file):
    args = build_parser({}).parse_args(["serve", "--chat-template", template_file])
    assert engine_config(args).model.chat_template == template_file
    environ = {"CHAT_TEMPLATE": template_file}
    assert engine_config(build_parser(environ).parse_args(["serve"])).model.chat_template == template_file


def test_offline_chat_errors_clearly_without_a_template_and_uses_a_given_one(template_file):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    base = LLM("llama-tiny", load_format="dummy", max_model_len=128, num_kv_blocks=32)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        base.chat(MESSAGES, params)
    assert len(base.generate("hello", params)[0].token_ids) == 2
    templated = LLM("llama-tiny", load_format="dummy", max_model_len=128, num_kv_blocks=32,
                    chat_template=TEMPLATE)
    result = templated.chat(MESSAGES, params)[0]
    assert result.prompt == "<user>hi\n<assistant>" and result.finish_reason == "length"


def test_a_template_that_is_neither_a_file_nor_jinja_is_refused():
    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ChatTemplateError, match="neither a file"):
        read_chat_template("/no/such/template.jinja")
