"""Reasoning models through the real routes (a scripted engine writes what each model writes):
chat completions' `reasoning_content` / `reasoning`, whole and streamed (markers split over
deltas, no end marker, no start marker where the template opens the block), reasoning tokens
in usage, the grammar gated to the answer (and not gated where the prompt closed the thinking),
special-token markers kept and EOS text dropped, harmony channels, `chat_template_kwargs` and
`reasoning_effort` reaching the template, earlier turns' thinking as the template wants it, the
Responses API's reasoning items and events, and Anthropic's thinking blocks."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest
from reasoning_templates import DEEPSEEK_R1, GPT_OSS, HARMONY_SPECIAL, MAGISTRAL, MAGISTRAL_SPECIAL, QWEN3
from scripted_engine import EOS_TEXT, ScriptedEngineClient, reasoning_tokenizer, scripted_app

from switchyard.core.grammar.gate import GrammarGate
from switchyard.core.scheduling.request import FinishReason

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THINK_TAGS = ("<think>", "</think>")
QWEN3_SCRIPT = ["<think>", "\nTwo and two", " make four.\n", "</think>", "\n\n", "4", EOS_TEXT]
R1_SCRIPT = ["Two and two", " make four.\n", "</think>", "\n\n", "4", EOS_TEXT]  # the template opened <think>
SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}


def _serve(template, script, special=(), added=(), finish_reason=FinishReason.EOS, **settings):
    tokenizer = reasoning_tokenizer(template, special, added)
    engine = ScriptedEngineClient(tokenizer, script if callable(script) else lambda request: list(script),
                                  finish_reason)
    return engine, scripted_app(engine, **settings)


def _num_tokens(engine, pieces) -> int:
    return sum(len(engine.tokenizer.encode(p, add_special_tokens=False)) for p in pieces)


def _chat(http, **body):
    response = http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _stream(http, **body) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json={"messages": ASK, "stream": True, **body}) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _streamed_text(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


# -- chat completions ----------------------------------------------------------------------------------
def test_qwen3_thinking_comes_back_apart_whole_and_streamed_with_its_tokens_counted():
    engine, app = _serve(QWEN3, QWEN3_SCRIPT, added=THINK_TAGS)
    with app as http:
        body = _chat(http)
        message = body["choices"][0]["message"]
        assert message["content"] == "4"
        assert message["reasoning_content"] == message["reasoning"] == "Two and two make four."
        reasoning_tokens = _num_tokens(engine, QWEN3_SCRIPT[:4])  # through </think>
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
        assert body["usage"]["completion_tokens"] == _num_tokens(engine, QWEN3_SCRIPT)

        chunks = _stream(http, stream_options={"include_usage": True})
        assert _streamed_text(chunks, "reasoning_content") == _streamed_text(chunks, "reasoning") == \
            "Two and two make four."
        assert _streamed_text(chunks, "content") == "4"
        kinds = [k for c in chunks if c["choices"] for k in ("reasoning_content", "content")
                 if c["choices"][0]["delta"].get(k)]
        assert kinds == ["reasoning_content"] * kinds.count("reasoning_content") + ["content"]  # thinking first
        assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
        assert engine.requests[-1].sampling_params.skip_special_tokens  # <think> is no special token


def test_markers_split_over_deltas_are_found():
    script = ["<thi", "nk>Two and", " two.</th", "ink", ">\n", "\n4"]
    _, app = _serve(QWEN3, script, added=THINK_TAGS)
    with app as http:
        chunks = _stream(http)
        assert _streamed_text(chunks, "reasoning_content") == "Two and two."
        assert _streamed_text(chunks, "content") == "4"
        assert _chat(http)["choices"][0]["message"]["content"] == "4"


def test_deepseek_r1_whose_template_opens_the_block_and_an_output_without_its_end():
    engine, app = _serve(DEEPSEEK_R1, R1_SCRIPT, added=THINK_TAGS)
    with app as http:
        message = _chat(http)["choices"][0]["message"]
        assert engine.prompt_text().endswith("<｜Assistant｜><think>\n")
        assert (message["reasoning_content"], message["content"]) == ("Two and two make four.", "4")
    cut = ["Still thinking", " about it"]
    engine, app = _serve(DEEPSEEK_R1, cut, added=THINK_TAGS, finish_reason=FinishReason.LENGTH)
    with app as http:
        body = _chat(http, max_tokens=4)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("Still thinking about it", "")
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == _num_tokens(engine, cut)
        chunks = _stream(http, max_tokens=4)
        assert _streamed_text(chunks, "reasoning") == "Still thinking about it"
        assert _streamed_text(chunks, "content") == ""


def test_a_grammar_applies_after_the_thinking():
    engine, app = _serve(QWEN3, ["<think>", "hm", "</think>", '{"a": 1}'], added=THINK_TAGS)
    think, end = (engine.tokenizer.encode(t, add_special_tokens=False) for t in THINK_TAGS)
    with app as http:
        message = _chat(http, response_format=SCHEMA)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("hm", '{"a": 1}')
        grammar = engine.requests[-1].sampling_params.grammar
        assert grammar.gate == GrammarGate(tuple(end), tuple(think))  # Qwen3 may answer without thinking
        assert engine.grammars[-1] == grammar  # the gated grammar is what was compiled first

        # chat_template_kwargs reach the template: no thinking, so the grammar applies from the start
        _chat(http, response_format=SCHEMA, chat_template_kwargs={"enable_thinking": False})
        assert engine.prompt_text().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert engine.requests[-1].sampling_params.grammar.gate is None
        _chat(http, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              tool_choice="required")
        assert engine.requests[-1].sampling_params.grammar.gate == GrammarGate(tuple(end), tuple(think))

    engine, app = _serve(DEEPSEEK_R1, R1_SCRIPT, added=THINK_TAGS)
    with app as http:
        _chat(http, response_format=SCHEMA)
        assert engine.requests[-1].sampling_params.grammar.gate == GrammarGate(tuple(end))  # thinking already

    engine, app = _serve(DEEPSEEK_R1, R1_SCRIPT, added=THINK_TAGS, reasoning_parser="none")
    with app as http:
        message = _chat(http, response_format=SCHEMA)["choices"][0]["message"]
        assert engine.requests[-1].sampling_params.grammar.gate is None
        assert message["content"] == "".join(R1_SCRIPT[:-1]) and "reasoning_content" not in message


def test_enable_thinking_false_is_all_answer():
    _, app = _serve(QWEN3, ["4"], added=THINK_TAGS)
    with app as http:
        body = _chat(http, chat_template_kwargs={"enable_thinking": False})
        message = body["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == ("4", None)
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_special_token_markers_are_kept_and_the_end_of_sequence_dropped():
    script = ["[THINK]", "Two and two.", "[/THINK]", "4", EOS_TEXT]
    engine, app = _serve(MAGISTRAL, script, special=MAGISTRAL_SPECIAL)
    with app as http:
        body = _chat(http)
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Two and two.", "4")
        assert not engine.requests[-1].sampling_params.skip_special_tokens  # or [THINK] would vanish
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == _num_tokens(engine, script[:3])
        chunks = _stream(http)
        assert (_streamed_text(chunks, "reasoning"), _streamed_text(chunks, "content")) == ("Two and two.", "4")


def test_gpt_oss_channels_and_reasoning_effort_in_the_template():
    script = ["<|channel|>", "analysis", "<|message|>", "Two and two.", "<|end|>", "<|start|>", "assistant",
              "<|channel|>", "final", "<|message|>", "4", "<|return|>"]
    engine, app = _serve(GPT_OSS, script, special=HARMONY_SPECIAL)
    with app as http:
        body = _chat(http, reasoning_effort="high", response_format=SCHEMA)
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Two and two.", "4")
        assert "Reasoning: high" in engine.prompt_text()
        final = tuple(engine.tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False))
        assert engine.requests[-1].sampling_params.grammar.gate == GrammarGate(final)
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == _num_tokens(engine, script[:10])
        chunks = _stream(http)
        assert (_streamed_text(chunks, "reasoning"), _streamed_text(chunks, "content")) == ("Two and two.", "4")
        bad = http.post("/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "extreme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_tool_calls_are_read_from_the_answer_after_the_thinking():
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    _, app = _serve(QWEN3, ["<think>", "I need the weather.", "</think>", "\n\n", call], added=THINK_TAGS)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with app as http:
        choice = _chat(http, tools=tools)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "I need the weather."
        assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}
        chunks = _stream(http, tools=tools)
        assert _streamed_text(chunks, "reasoning_content") == "I need the weather."
        assert [c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] for c in chunks
                if c["choices"] and c["choices"][0]["delta"].get("tool_calls") and
                "name" in c["choices"][0]["delta"]["tool_calls"][0]["function"]] == ["get_weather"]


def test_earlier_turns_thinking_reaches_the_template_as_it_wants_it():
    engine, app = _serve(QWEN3, QWEN3_SCRIPT, added=THINK_TAGS)
    with app as http:
        history = [*ASK, {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\n4"},
                   {"role": "user", "content": "And 3 + 3?"}]
        _chat(http, messages=history)
        assert "old thoughts" not in engine.prompt_text()  # before the last user message: dropped
        loop = [*ASK, {"role": "assistant", "content": "", "reasoning_content": "I need a tool.",
                       "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
        _chat(http, messages=loop)
        assert "<think>\nI need a tool.\n</think>" in engine.prompt_text()  # the current turn's: shown
    engine, app = _serve(DEEPSEEK_R1, R1_SCRIPT, added=THINK_TAGS)
    with app as http:
        _chat(http, messages=[*ASK, {"role": "assistant", "content": "4", "reasoning": "old thoughts"},
                              {"role": "user", "content": "And 3 + 3?"}])
        assert "old thoughts" not in engine.prompt_text()


# -- the Responses API --------------------------------------------------------------------------------
def test_responses_reasoning_items_whole_and_streamed():
    engine, app = _serve(QWEN3, QWEN3_SCRIPT, added=THINK_TAGS)
    with app as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        response = client.responses.create(model="reasoner", input="What is 2 + 2?", reasoning={"effort": "low"})
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "Two and two make four."
        assert response.output_text == "4"
        assert response.usage.output_tokens_details.reasoning_tokens == _num_tokens(engine, QWEN3_SCRIPT[:4])

        with client.responses.stream(model="reasoner", input="What is 2 + 2?") as stream:
            events = list(stream)
            final = stream.get_final_response()
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == "Two and two make four."
        done = [e for e in events if e.type == "response.reasoning_text.done"]
        assert len(done) == 1 and done[0].text == deltas and done[0].output_index == 0
        assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "4"
        assert final.output[0].content[0].text == deltas

        # a reasoning item sent back is the next assistant turn's thinking
        client.responses.create(model="reasoner", input=[
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "I need a tool."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"}])
        assert "<think>\nI need a tool.\n</think>" in engine.prompt_text()


# -- Anthropic's Messages API -------------------------------------------------------------------------
def test_anthropic_thinking_blocks_whole_and_streamed():
    engine, app = _serve(QWEN3, QWEN3_SCRIPT, added=THINK_TAGS)
    with app as http:
        client = anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0)
        message = client.messages.create(model="reasoner", messages=ASK, max_tokens=64,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "Two and two make four." and message.content[1].text == "4"
        assert engine.prompt_text().endswith("<|im_start|>assistant\n")  # enable_thinking: true

        with client.messages.stream(model="reasoner", messages=ASK, max_tokens=64,
                                    thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            events = list(stream)
            final = stream.get_final_message()
        thinking = "".join(e.delta.thinking for e in events
                           if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        assert thinking == "Two and two make four."
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
            ("thinking", thinking), ("text", "4")]
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["thinking", "text"]

        # thinking off reaches the template; earlier thinking blocks reach it as the turn's thinking
        client.messages.create(model="reasoner", messages=ASK, max_tokens=8, thinking={"type": "disabled"})
        assert engine.prompt_text().endswith("<think>\n\n</think>\n\n")
        client.messages.create(model="reasoner", max_tokens=8, messages=[
            *ASK,
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I need a tool.", "signature": ""},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}])
        assert "<think>\nI need a tool.\n</think>" in engine.prompt_text()


@pytest.mark.parametrize("template", [QWEN3, DEEPSEEK_R1])
def test_no_reasoning_parser_leaves_the_output_as_it_is(template):
    engine, app = _serve(template, QWEN3_SCRIPT, added=THINK_TAGS, reasoning_parser="none")
    with app as http:
        body = _chat(http)
        assert body["choices"][0]["message"]["content"] == "".join(QWEN3_SCRIPT[:-1])
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        refused = http.post("/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "high"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"


def test_a_thinking_budget_reaches_the_engine_as_the_gates_budget():
    engine, app = _serve(QWEN3, QWEN3_SCRIPT, added=THINK_TAGS)
    think, end = (engine.tokenizer.encode(t, add_special_tokens=False) for t in THINK_TAGS)
    with app as http:
        _chat(http, thinking_token_budget=5)
        grammar = engine.requests[-1].sampling_params.grammar  # any text after the budgeted thinking
        assert grammar.kind == "regex" and grammar.gate == GrammarGate(tuple(end), tuple(think), budget=5)
        _chat(http, thinking_token_budget=5, response_format=SCHEMA)
        grammar = engine.requests[-1].sampling_params.grammar
        assert grammar.kind == "json_schema" and grammar.gate.budget == 5
        _chat(http, thinking_token_budget=-1)
        assert engine.requests[-1].sampling_params.grammar is None  # no limit
        assert http.post("/v1/chat/completions", json={"messages": ASK, "thinking_token_budget": -2}).status_code == 400

        client = anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0)
        client.messages.create(model="reasoner", messages=ASK, max_tokens=64,
                               thinking={"type": "enabled", "budget_tokens": 7})
        assert engine.requests[-1].sampling_params.grammar.gate.budget == 7
        with pytest.raises(anthropic.BadRequestError, match="thinking.budget_tokens"):
            client.messages.create(model="reasoner", messages=ASK, max_tokens=8,
                                   thinking={"type": "enabled", "budget_tokens": -3})

    engine, app = _serve(QWEN3, QWEN3_SCRIPT, added=THINK_TAGS, reasoning_parser="none")
    with app as http:  # a model that does not reason: refused on chat, ignored with Anthropic's thinking
        refused = http.post("/v1/chat/completions", json={"messages": ASK, "thinking_token_budget": 5})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
        client = anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0)
        client.messages.create(model="reasoner", messages=ASK, max_tokens=8,
                               thinking={"type": "enabled", "budget_tokens": 1024})
        assert engine.requests[-1].sampling_params.grammar is None
