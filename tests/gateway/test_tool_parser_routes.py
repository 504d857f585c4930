"""Tool calls in a model's own format through the real routes: a scripted engine writes what
each model family writes (markers split over deltas, text before the calls, several calls),
and chat completions (whole, streamed, through the OpenAI SDK), the Responses API and
Anthropic's Messages API give back the calls the parser read; the tools and earlier turns are
rendered by the model's own template; `required` and named choices send a grammar in the
format (compiled by the real compiler); malformed calls come back as text. Last, the default
model itself, grammar-forced into the Hermes format, through a real server."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from scripted_engine import EOS_TEXT, ScriptedEngineClient, reasoning_tokenizer, scripted_app
from tool_templates import (DEEPSEEK_V3, DEEPSEEK_V31, GLM45, GPT_OSS, KIMI_K2, LLAMA31, LLAMA32_PYTHONIC,
                            MISTRAL_SMALL_32, MISTRAL_V03, QWEN25, QWEN3_CODER, SMOLLM2)

from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import make_compiler
from switchyard.core.scheduling.request import FinishReason

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                      "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                        "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris, and the time in UTC?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
MISTRAL_SPECIAL = ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[ARGS]")
KIMI_SPECIAL = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_end|>", "<|im_middle|>")
GLM_SPECIAL = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|assistant|>")
HARMONY_SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")

# format -> (template, special tokens, what the model writes (pieces), the text before its calls)
MODELS = {
    "hermes": (QWEN25, (), ["Let me", " check.\n<tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"ci",
                            "ty\": \"Paris\"}}\n</tool_",
                            "call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": ",
                            "{\"tz\": \"UTC\"}}\n</tool_call>", EOS_TEXT], "Let me check.\n"),
    "llama3_json": (LLAMA31, (), ["{\"name\": \"get_weather\", \"parameters\": {\"city\": ", "\"Paris\"}}; ",
                                  "{\"name\": \"get_time\", \"parameters\": {\"tz\": \"UTC\"}}", EOS_TEXT], None),
    "mistral": (MISTRAL_V03, MISTRAL_SPECIAL, ["Sure.", "[TOOL_CALLS]", "[{\"name\": \"get_weather\", \"arguments\": ",
                                               "{\"city\": \"Pa", "ris\"}}, {\"name\": \"get_time\", ",
                                               "\"arguments\": {\"tz\": \"UTC\"}}]", EOS_TEXT], "Sure."),
    "pythonic": (LLAMA32_PYTHONIC, (), ["[get_weather(city=", "'Paris'), get_time(", "tz=\"UTC\")]", EOS_TEXT], None),
    "qwen3_coder": (QWEN3_CODER, (), ["On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                                      "is\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_",
                                      "time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>", EOS_TEXT],
                    "On it.\n"),
    # the markers are plain text here (special_markers keep them where the tokenizer has them as special tokens)
    "deepseek_v3": (DEEPSEEK_V3, (), ["Sure.<｜tool▁calls▁begin｜><｜tool▁call",
                                      "▁begin｜>function<｜tool▁sep｜>get_weather\n", "```json\n{\"city\": \"Pa",
                                      "ris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function",
                                      "<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"UTC\"}\n```",
                                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", EOS_TEXT], "Sure."),
    "deepseek_v31": (DEEPSEEK_V31, (), ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": ",
                                        "\"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"tz\": ",
                                        "\"UTC\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", EOS_TEXT], None),
    "kimi_k2": (KIMI_K2, KIMI_SPECIAL, ["Sure. ", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                        "functions.get_weather:0", "<|tool_call_argument_begin|>", "{\"city\": \"Pa",
                                        "ris\"}", "<|tool_call_end|>", "<|tool_call_begin|>", "functions.get_time:1",
                                        "<|tool_call_argument_begin|>", "{\"tz\": \"UTC\"}", "<|tool_call_end|>",
                                        "<|tool_calls_section_end|>", EOS_TEXT], "Sure. "),
    "glm45": (GLM45, GLM_SPECIAL, ["On it.\n", "<tool_call>", "get_weather\n", "<arg_key>", "city", "</arg_key>", "\n",
                                   "<arg_value>", "Paris", "</arg_value>", "\n", "</tool_call>", "\n", "<tool_call>",
                                   "get_time\n", "<arg_key>", "tz", "</arg_key>", "<arg_value>", "UTC", "</arg_value>",
                                   "</tool_call>", EOS_TEXT], "On it.\n"),
    # through the gpt_oss reasoning parser, which takes the analysis out and leaves the calls as the answer
    "openai": (GPT_OSS, HARMONY_SPECIAL, ["<|channel|>", "analysis", "<|message|>", "Need both.", "<|end|>",
                                          "<|start|>", "assistant", "<|channel|>", "commentary", "<|message|>",
                                          "Checking.", "<|end|>", "<|start|>", "assistant", "<|channel|>",
                                          "commentary to=functions.get_weather ", "<|constrain|>", "json",
                                          "<|message|>", "{\"city\": \"Pa", "ris\"}", "<|call|>", "<|start|>",
                                          "assistant", "<|channel|>", "commentary to=functions.get_time ",
                                          "<|constrain|>", "json", "<|message|>", "{\"tz\": \"UTC\"}", "<|call|>"],
               "Checking."),
}


class CompilingEngine(ScriptedEngineClient):
    """Also compiles each grammar with the real xgrammar compiler: one it cannot is a 400."""

    def __init__(self, *args, compiler, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiler = compiler

    async def compile_grammar(self, spec) -> None:
        await super().compile_grammar(spec)
        self.compiler.compile(spec)


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    return make_compiler(GrammarConfig(), default_tokenizer, len(default_tokenizer), (2,))


def _serve(template, script, special=(), finish_reason=FinishReason.EOS, compiler=None, **settings):
    tokenizer = reasoning_tokenizer(template, special)
    make = (lambda *a, **k: CompilingEngine(*a, compiler=compiler, **k)) if compiler else ScriptedEngineClient
    engine = make(tokenizer, script if callable(script) else lambda request: list(script), finish_reason)
    return engine, scripted_app(engine, **settings)


def _chat(http, **body) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _stream(http, **body) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": ASK, "tools": TOOLS, "stream": True, **body}) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]


def _ids_are(name: str, ids: list[str]) -> bool:
    """Kimi K2 writes its own call ids (functions.NAME:IDX), which are kept; others get call_..."""
    if name == "kimi_k2":
        return ids == ["functions.get_weather:0", "functions.get_time:1"]
    return all(i.startswith("call_") for i in ids)


def _streamed(chunks: list[dict], name: str = "") -> tuple[str, list[tuple[str, dict]], str]:
    """The content, the calls and the finish_reason a client accumulates from the chunks; every
    call's first delta carries its id, type and name with empty arguments, later ones only arguments."""
    content, calls, finish, ids = "", {}, None, []
    for chunk in chunks:
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        for delta in choice["delta"].get("tool_calls") or ():
            if delta["index"] not in calls:
                ids.append(delta["id"])
                assert delta["type"] == "function"
                assert delta["function"]["arguments"] == "" and delta["function"]["name"]
                calls[delta["index"]] = [delta["function"]["name"], ""]
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                calls[delta["index"]][1] += delta["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    assert _ids_are(name, ids)
    return content, [(call, json.loads(arguments)) for call, arguments in calls.values()], finish


# -- chat completions --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_format_is_read_whole_and_streamed(name):
    template, special, script, before = MODELS[name]
    engine, app = _serve(template, script, special)
    with app as http:
        choice = _chat(http)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == before and _calls(choice["message"]) == CALLS
        assert _ids_are(name, [call["id"] for call in choice["message"]["tool_calls"]])
        assert engine.requests[-1].sampling_params.skip_special_tokens == (not special)

        chunks = _stream(http)
        assert _streamed(chunks, name) == (before or "", CALLS, "tool_calls")
        pieces = [d["function"]["arguments"] for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or ()
                  if "id" not in d]
        assert len(pieces) > len(CALLS)  # the arguments came as they were generated, not at the end
        if before:  # the text before the calls came first, as content
            kinds = ["content" if c["choices"][0]["delta"].get("content") else "calls" for c in chunks
                     if c["choices"][0]["delta"].get("content") or c["choices"][0]["delta"].get("tool_calls")]
            assert kinds[0] == "content" and "content" not in kinds[kinds.index("calls"):]


def test_the_openai_sdk_accumulates_the_streamed_calls():
    _, app = _serve(QWEN25, MODELS["hermes"][2])
    with app as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        with client.beta.chat.completions.stream(model="reasoner", messages=ASK, tools=TOOLS) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        message = final.choices[0].message
        assert message.content == "Let me check.\n" and final.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == CALLS


def test_malformed_calls_come_back_as_text_with_stop():
    broken = ["Let me check.\n<tool_call>\n{\"name\": \"get_weather\" \"arguments\": ", "{}}\n</tool_call>"]
    _, app = _serve(QWEN25, broken)
    with app as http:
        choice = _chat(http)["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "".join(broken)
        assert _streamed(_stream(http)) == ("".join(broken), [], "stop")


def test_a_plain_answer_streams_as_it_comes():
    _, app = _serve(QWEN25, ["It is", " sunny", " in Paris.", EOS_TEXT])
    with app as http:
        chunks = _stream(http)
        assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["It is", " sunny", " in Paris."]
        assert _chat(http)["choices"][0]["message"]["content"] == "It is sunny in Paris."


def test_a_call_cut_off_by_max_tokens_is_a_call_with_finish_reason_length():
    cut = ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa"]
    _, app = _serve(QWEN25, cut, finish_reason=FinishReason.LENGTH)
    with app as http:
        choice = _chat(http, max_tokens=12)["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


# -- the prompt ------------------------------------------------------------------------------------
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_0123456789abcdef01234567", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "18 degrees"}]

# template -> what its prompt shows of the tools, and of the earlier call and its result
RENDERED = {
    "hermes": (QWEN25, ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                        "<tool_response>\n18 degrees\n</tool_response>"]),
    "llama3_json": (LLAMA31, ["Given the following functions", '    "type": "function",',
                              '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                              'ipython<|end_header_id|>\n\n"18 degrees"']),
    "mistral": (MISTRAL_V03, ['[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"',
                              # its template takes 9-character ids: ours are cut to their last 9
                              '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
                              '"id": "f01234567"}]',
                              '[TOOL_RESULTS] {"content": 18 degrees, "call_id": "f01234567"}[/TOOL_RESULTS]']),
    "pythonic": (LLAMA32_PYTHONIC, ["[func_name1(params_name1=params_value1", '"name": "get_weather"',
                                    "[get_weather(city='Paris')]<|eot_id|>", "ipython<|end_header_id|>\n\n18 degrees"]),
    "qwen3_coder": (QWEN3_CODER, ["<function>\n<name>get_weather</name>", "<name>city</name>\n<type>string</type>",
                                  "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>",
                                  "<tool_response>\n18 degrees\n</tool_response>"]),
    "deepseek_v3": (DEEPSEEK_V3, ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
                                  # its template joins the arguments as text: they go to it as JSON text
                                  '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
                                  '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                                  "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18 degrees<｜tool▁output▁end｜>"]),
    "deepseek_v31": (DEEPSEEK_V31, ['You have access to the following tools:\n{"type": "function"',
                                    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                                    '<｜tool▁call▁end｜>', "<｜tool▁output▁begin｜>18 degrees<｜tool▁output▁end｜>"]),
    "kimi_k2": (KIMI_K2, ['tool_declare<|im_middle|>[{"type": "function", "function": {"name": "get_weather"',
                          # its template writes the call ids back: ours become Kimi's shape, the result follows
                          '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
                          '<|tool_call_end|>', "## Return of functions.get_weather:0\n18 degrees"]),
    "glm45": (GLM45, ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
                      "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                      "<|observation|>\n<tool_response>\n18 degrees\n</tool_response>"]),
    "openai": (GPT_OSS, ["namespace functions {", 'type get_weather = (_: {"type": "object"',
                         '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                         '{"city": "Paris"}<|call|>',
                         '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 degrees"'
                         '<|end|>']),
}


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_tools_and_earlier_calls_are_rendered_by_the_models_template(name):
    template, shown = RENDERED[name]
    engine, app = _serve(template, ["Done."], MODELS[name][1])
    with app as http:
        _chat(http, messages=HISTORY)
        prompt = engine.prompt_text()
        for text in shown:
            assert text in prompt, (text, prompt)
        assert "You can call these functions" not in prompt  # no system prompt of ours: the template's own


def test_a_parser_named_for_a_template_without_tools_tells_the_model_its_format():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    engine, app = _serve(SMOLLM2, [call], tool_call_parser="hermes")
    with app as http:
        message = _chat(http, messages=HISTORY)["choices"][0]["message"]
        assert _calls(message) == [("get_time", {"tz": "UTC"})]
        prompt = engine.prompt_text()
        assert '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>' in prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt


# -- required and named: a grammar in the format -----------------------------------------------------
def test_required_and_named_send_a_grammar_in_the_models_format(compiler):
    call = '<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>'
    engine, app = _serve(QWEN25, [call], compiler=compiler)
    with app as http:
        choice = _chat(http, tool_choice="required")["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and _calls(choice["message"]) == [("get_time", {"tz": "UTC"})]
        spec = engine.requests[-1].sampling_params.grammar
        assert spec.kind == "structural" and engine.grammars[-1] == spec
        assert '"value":"<tool_call>\\n"' in spec.value and '"type":"star"' in spec.value  # one call or more
        assert '"get_weather"' in spec.value and '"get_time"' in spec.value

        choice = _chat(http, tool_choice={"type": "function", "function": {"name": "get_time"}})["choices"][0]
        assert choice["finish_reason"] == "stop" and _calls(choice["message"]) == [("get_time", {"tz": "UTC"})]
        spec = engine.requests[-1].sampling_params.grammar
        assert '"get_weather"' not in spec.value and '"type":"star"' not in spec.value  # that one call only

        _chat(http, tool_choice="required", parallel_tool_calls=False)
        assert '"type":"star"' not in engine.requests[-1].sampling_params.grammar.value
        assert _streamed(_stream(http, tool_choice="required")) == ("", [("get_time", {"tz": "UTC"})], "tool_calls")


def test_required_and_named_in_deepseeks_format(compiler):
    call = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz":"UTC"}\n```'
            '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    engine, app = _serve(DEEPSEEK_V3, [call], compiler=compiler)
    with app as http:
        choice = _chat(http, tool_choice="required")["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and _calls(choice["message"]) == [("get_time", {"tz": "UTC"})]
        spec = engine.requests[-1].sampling_params.grammar
        text = json.dumps(spec.structure, ensure_ascii=False)
        assert spec.kind == "structural" and '"value": "<｜tool▁calls▁begin｜>"' in text
        assert '"get_weather\\n```json\\n"' in text and '"type": "star"' in text
        choice = _chat(http, tool_choice={"type": "function", "function": {"name": "get_time"}})["choices"][0]
        assert choice["finish_reason"] == "stop" and _calls(choice["message"]) == [("get_time", {"tz": "UTC"})]
        assert '"get_weather' not in engine.requests[-1].sampling_params.grammar.value


def test_a_mistral_grammar_requires_its_marker_token_and_the_json_parser_keeps_the_old_format():
    engine, app = _serve(MISTRAL_SMALL_32, ["[TOOL_CALLS]", "get_time", "[ARGS]", "{\"tz\": \"UTC\"}", EOS_TEXT],
                         MISTRAL_SPECIAL)
    with app as http:
        choice = _chat(http, tool_choice="required")["choices"][0]
        assert _calls(choice["message"]) == [("get_time", {"tz": "UTC"})]
        spec = engine.requests[-1].sampling_params.grammar
        assert '{"type":"token","token":"[TOOL_CALLS]"}' in spec.value and '"[ARGS]"' in spec.value
    engine, app = _serve(QWEN25, ['{"name": "get_time", "arguments": {"tz": "UTC"}}'], tool_call_parser="json")
    with app as http:
        choice = _chat(http, tool_choice="required", parallel_tool_calls=False)["choices"][0]
        assert _calls(choice["message"]) == [("get_time", {"tz": "UTC"})]
        assert engine.requests[-1].sampling_params.grammar.kind == "json_schema"


def test_special_token_markers_are_kept_and_other_special_tokens_still_skipped():
    engine, app = _serve(MISTRAL_V03, ["It is sunny.", EOS_TEXT], MISTRAL_SPECIAL)
    with app as http:
        assert _chat(http)["choices"][0]["message"]["content"] == "It is sunny."
        assert not engine.requests[-1].sampling_params.skip_special_tokens  # for [TOOL_CALLS]
        assert _streamed(_stream(http))[0] == "It is sunny."
        kept = _chat(http, skip_special_tokens=False)["choices"][0]["message"]["content"]
        assert kept == "It is sunny." + EOS_TEXT  # the client asked for them
        _chat(http, tool_choice="none")
        assert engine.requests[-1].sampling_params.skip_special_tokens  # no call to read


# -- the Responses API and Anthropic's Messages API ---------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                   for t in TOOLS]


def test_responses_function_call_items_come_from_the_parser():
    _, app = _serve(QWEN25, MODELS["hermes"][2])
    with app as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        response = client.responses.create(model="reasoner", input="Weather?", tools=RESPONSES_TOOLS)
        assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
        assert response.output[0].content[0].text == "Let me check.\n"
        assert [(i.name, json.loads(i.arguments)) for i in response.output[1:]] == CALLS

        with client.responses.stream(model="reasoner", input="Weather?", tools=RESPONSES_TOOLS) as stream:
            events = list(stream)
            final = stream.get_final_response()
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 2
        done = [(e.name, json.loads(e.arguments)) for e in events if e.type == "response.function_call_arguments.done"]
        assert done == CALLS
        assert [item.type for item in final.output] == ["message", "function_call", "function_call"]


def test_anthropic_tool_use_blocks_come_from_the_parser():
    _, app = _serve(QWEN3_CODER, MODELS["qwen3_coder"][2])
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    with app as http:
        client = anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0)
        message = client.messages.create(model="reasoner", messages=ASK, max_tokens=64, tools=tools)
        assert message.stop_reason == "tool_use"
        assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
        assert message.content[0].text == "On it.\n"
        assert [(b.name, b.input) for b in message.content[1:]] == CALLS

        with client.messages.stream(model="reasoner", messages=ASK, max_tokens=64, tools=tools) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["text", "tool_use",
                                                                                            "tool_use"]
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == CALLS
        assert final.stop_reason == "tool_use"


# -- the default model, grammar-forced into a format ---------------------------------------------------
def test_the_default_model_forced_into_the_hermes_format_through_a_real_server(start_server):
    server = start_server(tool_call_parser="hermes")
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
    tools = [WEATHER]
    reply = client.chat.completions.create(model="default", messages=ASK, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice  # the grammar ended after one call
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    several = client.chat.completions.create(model="default", messages=ASK, tools=tools, tool_choice="required",
                                             max_tokens=60, temperature=0).choices[0]
    assert several.message.tool_calls and all(c.function.name == "get_weather" for c in several.message.tool_calls)

    stream = client.chat.completions.create(model="default", messages=ASK, tools=tools, max_tokens=60, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            stream=True)
    names, arguments, finish = [], "", None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or ():
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "stop"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
