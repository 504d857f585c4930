"""core/text/serving_tokenizer.py and core/text/chat_template.py against transformers: the gateway's
tokenizer (no transformers) encodes, decodes and renders chat templates exactly as the
transformers tokenizer it was made from, on the default model's tokenizer, Gemma 3's (the GGUF
package) and the byte-level test tokenizer."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from switchyard.core.text.chat_template import ChatTemplateError, render_chat
from switchyard.core.config import ModelConfig
from switchyard.core.loader import load_hf_tokenizer, load_tokenizer
from switchyard.core.text.serving_tokenizer import ServingTokenizer, gateway_tokenizer

TEXTS = ["Hello world", "  leading and trailing spaces  ", "naïve café — 東京 🚀 emoji",
         "line\nbreaks\n\n\ttabs",
         "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>model\n", "don't , stop . now ?", ""]


@pytest.fixture(scope="module", params=["default", "gemma3", "byte-level"])
def pair(request):
    if request.param == "default":
        model = ModelConfig(model=None)
    elif request.param == "gemma3":
        model = ModelConfig(model=request.getfixturevalue("gemma3_gguf_path"))
    else:
        model = ModelConfig(model="llama-tiny", load_format="dummy")
    hf = load_hf_tokenizer(model)
    return hf, ServingTokenizer.from_transformers(hf)


def test_encode_decode_and_single_tokens_match_transformers(pair):
    hf, lean = pair
    assert len(lean) == len(hf)
    assert lean.all_special_ids == hf.all_special_ids
    assert lean.get_vocab() == hf.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert lean.encode(text, add_special_tokens=special) == ids, text
            ours, theirs = lean(text, add_special_tokens=special, return_offsets_mapping=True), \
                hf(text, add_special_tokens=special, return_offsets_mapping=True)
            assert ours["input_ids"] == theirs["input_ids"]
            assert [tuple(o) for o in ours["offset_mapping"]] == [tuple(o) for o in theirs["offset_mapping"]]
        ids = hf.encode(text) + hf.all_special_ids
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    some = list(range(0, len(hf), max(1, len(hf) // 997)))
    assert lean.convert_ids_to_tokens(some) == hf.convert_ids_to_tokens(some)
    pieces = hf.convert_ids_to_tokens(some) + ["surely-not-a-token-of-any-vocabulary"]
    assert lean.convert_tokens_to_ids(pieces) == hf.convert_tokens_to_ids(pieces)
    assert [lean.decode([i]) for i in some] == [hf.decode([i]) for i in some]


def test_pickled_round_trip_is_the_same_tokenizer(pair):
    _, lean = pair
    copy = pickle.loads(pickle.dumps(lean))
    assert copy.encode(TEXTS[2]) == lean.encode(TEXTS[2])
    assert copy.chat_template == lean.chat_template and copy.special_tokens_map == lean.special_tokens_map


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? ünïcödé 東京"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "name": "get_weather"}],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_model_templates_render_as_transformers_renders_them(pair, generation_prompt):
    hf, lean = pair
    if not hf.chat_template:
        with pytest.raises(ChatTemplateError, match="no chat template"):
            render_chat(lean, CONVERSATIONS[0])
        return
    for messages in CONVERSATIONS:
        try:
            expected = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception:  # noqa: BLE001 - e.g. a template that needs every message's content
            with pytest.raises(ChatTemplateError):
                render_chat(lean, messages, generation_prompt)
            continue
        assert render_chat(lean, messages, generation_prompt) == expected
        assert render_chat(hf, messages, generation_prompt) == expected  # the in-process LLM's tokenizer


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# what Hub templates use: tojson (non-ASCII kept, indent), namespace, loop controls, generation
# blocks, the special tokens, raise_exception, strftime_now, dict(), a request's own variables
FEATURES = """{{ bos_token }}{% set ns = namespace(n=0) %}{% if tools %}TOOLS {{ tools | tojson(indent=1) }}
{% endif %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}
{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}
{% endif %}{% if m.reasoning_content %}(thought: {{ m.thinking }}){% endif %}{% endfor %}{{ ns.n }} {{ dict(a=1) | tojson }}
{% if strftime_now('%Y') | int < 2000 %}{{ raise_exception('clock') }}{% endif %}{% if flavor %}{{ flavor }}{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"""


def test_template_features_render_as_transformers_renders_them(pair):
    hf, lean = pair
    hf.chat_template, lean.chat_template = FEATURES, FEATURES
    try:
        messages = [{"role": "system", "content": "ß"}, {"role": "skip", "content": "x"},
                    {"role": "assistant", "content": "ok", "reasoning": "because"}, {"role": "user", "content": "go"}]
        for kwargs in ({}, {"tools": TOOLS}, {"flavor": "vanilla"}):
            expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
            assert render_chat(lean, messages, True, **kwargs) == expected
        failing = FEATURES.replace("< 2000", "> 2000")
        hf.chat_template, lean.chat_template = failing, failing
        with pytest.raises(ChatTemplateError, match="clock"):
            render_chat(lean, messages)
        unsafe = "{% set ns = namespace() %}{% set ns._x = 1 %}"
        lean.chat_template = unsafe
        with pytest.raises(ChatTemplateError):
            render_chat(lean, messages)
    finally:
        hf.chat_template = lean.chat_template = None


def test_named_templates_pick_tool_use_with_tools():
    lean = gateway_tokenizer(load_tokenizer(ModelConfig(model="llama-tiny", load_format="dummy")))
    lean.chat_template = {"default": "plain", "tool_use": "tools {{ tools | length }}"}
    assert render_chat(lean, CONVERSATIONS[0]) == "plain"
    assert render_chat(lean, CONVERSATIONS[0], tools=TOOLS) == "tools 1"
    lean.chat_template = {"rag": "x"}
    with pytest.raises(ChatTemplateError, match="several chat templates"):
        render_chat(lean, CONVERSATIONS[0])


def test_the_gateway_holds_its_tokenizer_without_importing_transformers():
    """Unpickling the engine's tokenizer and rendering a chat imports neither transformers nor
    torch (the gateway's memory; core/text/serving_tokenizer.py)."""
    lean = gateway_tokenizer(load_tokenizer(ModelConfig(model=None)))
    script = ("import pickle, sys\n"
              "from switchyard.core.text.chat_template import render_chat\n"
              "tok = pickle.loads(sys.stdin.buffer.read())\n"
              "text = render_chat(tok, [{'role': 'user', 'content': 'hi'}])\n"
              "assert tok.encode(text, add_special_tokens=False)\n"
              "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(lean), capture_output=True, check=True)
    assert out.stdout.decode().strip() == "[]"


def test_build_makes_the_rust_tokenizer_now_and_hands_the_parse_heap_back(monkeypatch):
    """The gateway builds its tokenizer when the engine is ready (core/engine/client.py), not on the
    first request, and trims the heap the JSON parse freed (~25 of ~40 MB for the default's)."""
    from switchyard.core.text import serving_tokenizer

    trims = []
    monkeypatch.setattr(serving_tokenizer, "trim_heap", lambda: trims.append(1) or True)
    lean = pickle.loads(pickle.dumps(gateway_tokenizer(load_tokenizer(ModelConfig()))))
    assert "backend_tokenizer" not in vars(lean)
    assert lean.build() is lean and "backend_tokenizer" in vars(lean) and trims == [1]
    assert lean.encode("Hello") == load_hf_tokenizer(ModelConfig()).encode("Hello")
