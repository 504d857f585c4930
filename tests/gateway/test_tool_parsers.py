"""Tool-call parsers (gateway/tool_parsers) without a server: each format read whole and as a
stream (markers split over deltas, several calls, content before them), malformed calls left
as content, calls written back and read again, auto selection from chat templates, and the
--tool-call-parser flag. Then what one format does beyond the others: DeepSeek's two forms,
Kimi K2's call ids, GLM-4.5's typed values, gpt-oss's harmony messages."""
from __future__ import annotations

import json
import random

import pytest
from tool_templates import (DEEPSEEK_V3, DEEPSEEK_V31, EXPECTED, GLM45, GPT_OSS, KIMI_K2, MISTRAL_SMALL_32, QWEN25,
                            SMOLLM2)

from switchyard.core.params import ValidationError
from switchyard.gateway.openai.tools import Tool
from switchyard.gateway.tool_parsers import (CallStream, FormatContext, ParsedOutput, ToolCall, ToolFormat,
                                             detect_parser, get_parser, parse_output, parser_name, parser_names,
                                             tool_format)

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})
TIME = Tool("get_time", "Time in a zone", {"type": "object", "properties": {"tz": {"type": "string"}},
                                           "required": ["tz"]})
TOOLS = (WEATHER, TIME)
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})]

# format -> (an output with text before two calls, that text as content; None: the format has no text before calls)
OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
               "Let me check.\n"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"tz": "UTC"}}', None),
    "mistral": ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {"tz": "UTC"}}]', "Sure. "),
    "pythonic": ("[get_weather(city='Paris', days=2), get_time(tz=\"UTC\")]", None),
    "qwen3_coder": ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>", "I will look.\n"),
    "deepseek_v3": ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure."),
    "deepseek_v31": ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
                     '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜>'
                     '<｜tool▁calls▁end｜>', "Sure."),
    "kimi_k2": ('Sure. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>'
                '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "UTC"}<|tool_call_end|>'
                '<|tool_calls_section_end|>', "Sure. "),
    "glm45": ("On it.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n"
              "<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>", "On it.\n"),
    "openai": ('Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city": "Paris", "days": 2}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time '
               '<|constrain|>json<|message|>{"tz": "UTC"}<|call|>', "Checking."),
}
# format -> outputs that begin a call but are none, found so before the call's name is known: all of
# each is content, whole and streamed
MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', "Hi <tool_call>not json</tool_call>",
               '<tool_call>\n{"arguments": {}, "nme": "get_time"}\n</tool_call>'],
    "llama3_json": ['{"city": "Paris"}', '{"name": 7, "parameters": {}}', "{not json}"],
    "mistral": ["[TOOL_CALLS] nothing", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', "[TOOL_CALLS][1, 2]"],
    "pythonic": ["[1, 2, 3]", "[get_weather city='x']", "[nope(a=1)]"],
    "qwen3_coder": ["<tool_call>\n<function=nope>\n</function>\n</tool_call>", "<tool_call>text</tool_call>"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>nope\n```json\n{}\n```<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>", "Hi <｜tool▁calls▁begin｜>not a call<｜tool▁calls▁end｜>",
                    "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"],
    "deepseek_v31": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                     "<｜tool▁calls▁begin｜>[1, 2]",
                     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜>"],
    "kimi_k2": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}"
                "<|tool_call_end|><|tool_calls_section_end|>",
                "<|tool_calls_section_begin|><|tool_call_begin|>get_time<|tool_call_argument_begin|>{}<|tool_call_end|>"
                "<|tool_calls_section_end|>"],
    "glm45": ["<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
              "<tool_call>\n<arg_key>city</arg_key>\n</tool_call>"],
    "openai": ["<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>",
               "Hi <|channel|>commentary to=functions.get_weather <|constrain|>json"],
}
# found so after the name: whole, all content; streamed, the call's name (and arguments) went out already
MALFORMED_LATE = {
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace short
               '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Paris"}} and more'],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'],
    "pythonic": ["[get_weather(Paris)]", "[get_weather(city=os.system('x'))]", "[get_weather(city='Paris')] and text"],
    "qwen3_coder": ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"],
    "deepseek_v3": ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n{"city": "Paris"}'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',  # no json fence
                    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"'
                    '\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'],
    "deepseek_v31": ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}} '
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>'],
    "kimi_k2": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>[1]"
                "<|tool_call_end|><|tool_calls_section_end|>"],
    "glm45": ["<tool_call>get_weather\nnot a pair\n</tool_call>"],
    "openai": ["<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>not json<|call|>"],
}

def _parser(name: str, template: str = "", special: frozenset[str] = frozenset()):
    return ToolFormat(get_parser(name), FormatContext(template, special)).for_tools(TOOLS)


def _run(stream: CallStream, pieces: list[str], cut_off: bool = False) -> list[tuple]:
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    return events + stream.finish(cut_off)


def _assembled(events: list[tuple]) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = "", {}
    for event in events:
        if event[0] == "content":
            content += event[1]
        elif event[0] == "call":
            assert event[1] not in calls, "a call's name is sent once"
            calls[event[1]] = [event[2], ""]
        else:
            assert event[1] in calls, "arguments come after their call's name"
            calls[event[1]][1] += event[2]
    assert sorted(calls) == list(range(len(calls)))
    return content, [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))]


def _splits(text: str, seed: int) -> list[str]:
    """`text` cut at random places, every marker cut somewhere too."""
    rng = random.Random(seed)
    cuts = sorted({rng.randrange(1, len(text)) for _ in range(len(text) // 4)})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_every_format_is_registered_once():
    assert parser_names() == ("deepseek_v3", "deepseek_v31", "glm45", "hermes", "kimi_k2", "llama3_json", "mistral",
                              "openai", "pythonic", "qwen3_coder")


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_whole_output_gives_content_and_several_calls(name):
    text, content = OUTPUTS[name]
    out = parse_output(_parser(name), text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == CALLS
    only_first = parse_output(_parser(name), text, parallel=False)
    assert [c.name for c in only_first.calls] == ["get_weather"]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("how", ["characters", "random", "whole"])
def test_streamed_output_sends_content_then_each_name_then_its_arguments(name, how):
    text, content = OUTPUTS[name]
    pieces = {"characters": list(text), "random": _splits(text, 7), "whole": [text]}[how]
    events = _run(CallStream(_parser(name)), pieces)
    streamed_content, calls = _assembled(events)
    assert (streamed_content or None) == content and calls == CALLS
    kinds = [event[0] for event in events]
    assert "content" not in kinds[kinds.index("call"):]  # all the content came before the first call
    if how == "characters":  # the arguments came in pieces, as they were written
        assert sum(1 for event in events if event[0] == "arguments" and event[1] == 0) > 1


def test_a_marker_split_over_deltas_is_held_back_and_text_that_is_none_is_sent():
    stream = CallStream(_parser("hermes"))
    assert stream.feed("Hello <tool") == [("content", "Hello ")]
    assert stream.feed("s> are fine") == [("content", "<tools> are fine")]
    assert stream.feed(" <tool_") == [("content", " ")]
    assert stream.feed("call>") == []
    assert stream.finish() == [("content", "<tool_call>")]  # an unfinished call at the end: content


@pytest.mark.parametrize(("name", "text"), [(name, text) for name, texts in MALFORMED.items() for text in texts])
def test_malformed_calls_are_left_as_content_whole_and_streamed(name, text):
    out = parse_output(_parser(name), text)
    assert (out.content, out.calls) == (text, ())
    for pieces in (list(text), [text]):
        assert _assembled(_run(CallStream(_parser(name)), pieces)) == (text, [])


@pytest.mark.parametrize(("name", "text"), [(name, text) for name, texts in MALFORMED_LATE.items() for text in texts])
def test_a_call_that_goes_wrong_after_its_name_is_content_whole_and_stays_a_call_streamed(name, text):
    out = parse_output(_parser(name), text)
    assert (out.content, out.calls) == (text, ())
    events = _run(CallStream(_parser(name)), list(text))
    assert [event for event in events if event[0] == "call"] == [("call", 0, "get_weather")]
    assert not [event for event in events if event[0] == "content"]


def test_a_call_cut_off_by_the_length_limit_keeps_what_was_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    out = parse_output(_parser("hermes"), text, cut_off=True)
    assert out.content is None and [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city": "Par')]
    events = _run(CallStream(_parser("hermes")), [text], cut_off=True)
    assert events == [("call", 0, "get_weather"), ("arguments", 0, '{"city": "Par')]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_calls_written_in_a_format_read_back_the_same(name):
    parser = _parser(name)
    calls = [ToolCall(n, json.dumps(a)) for n, a in CALLS]
    out = parse_output(parser, parser.render(calls))
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == CALLS and out.content is None
    assert parser.instructions()


def test_mistral_reads_both_its_formats_and_writes_the_one_its_template_shows():
    newer = _parser("mistral", MISTRAL_SMALL_32)
    text = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    for parser in (newer, _parser("mistral")):
        out = parse_output(parser, text)
        assert out.content == "Checking." and [(c.name, json.loads(c.arguments)) for c in out.calls] == CALLS
        assert _assembled(_run(CallStream(parser), list(text))) == ("Checking.", CALLS)
    assert newer.render([ToolCall("get_time", '{"tz": "UTC"}')]) == '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    assert _parser("mistral").render([ToolCall("get_time", '{"tz": "UTC"}')]).startswith('[TOOL_CALLS][{"name"')


def test_special_tokens_kept_for_the_markers_are_hidden_again():
    special = frozenset({"[TOOL_CALLS]", "[ARGS]", "<|im_end|>", "<s>"})
    parser = _parser("mistral", MISTRAL_SMALL_32, special)
    assert parser.keeps_special_tokens and not _parser("mistral").keeps_special_tokens
    hidden = special - {"[TOOL_CALLS]", "[ARGS]"}
    text = 'Hi<|im_end|>'
    assert parse_output(parser, text, hidden=hidden).content == "Hi"
    assert _assembled(_run(CallStream(parser, hidden=hidden), ["Hi<|im", "_end|>"])) == ("Hi", [])
    call = '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}<|im_end|>'
    assert [c.name for c in parse_output(parser, call, hidden=hidden).calls] == ["get_time"]


def test_llama3_calls_may_be_separated_by_whitespace_alone():
    text = ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}\n'
            '{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert [(c.name, json.loads(c.arguments)) for c in parse_output(_parser("llama3_json"), text).calls] == CALLS
    assert _assembled(_run(CallStream(_parser("llama3_json")), list(text))) == ("", CALLS)


def test_pythonic_values_are_python_or_json_literals_and_never_evaluated():
    parser = _parser("pythonic")
    text = "[get_weather(city='Zoë', days=-3, extra=[True, None, {'a': 1.5}], more=null, on=true)]"
    call, = parse_output(parser, text).calls
    assert json.loads(call.arguments) == {"city": "Zoë", "days": -3, "extra": [True, None, {"a": 1.5}],
                                          "more": None, "on": True}
    assert parse_output(parser, "[get_time()]").calls[0].arguments == "{}"
    assert parse_output(parser, "[get_time(tz=__import__('os'))]").calls == ()


def test_qwen3_coder_values_follow_their_schema_types():
    tool = Tool("f", None, {"type": "object", "properties": {
        "text": {"type": "string"}, "n": {"type": "integer"}, "opts": {"type": "object"}, "flag": {"type": "boolean"}}})
    parser = ToolFormat(get_parser("qwen3_coder"), FormatContext()).for_tools([tool])
    text = ("<tool_call>\n<function=f>\n<parameter=text>\n42\nlines\n</parameter>\n<parameter=n>\n7\n</parameter>\n"
            "<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n</function>\n"
            "</tool_call>")
    call, = parse_output(parser, text).calls
    assert json.loads(call.arguments) == {"text": "42\nlines", "n": 7, "opts": {"a": [1]}, "flag": True}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_auto_selection_takes_the_format_the_template_shows(name):
    assert detect_parser(EXPECTED[name]).name == name


def test_auto_selection_takes_none_where_no_format_or_several_show():
    assert detect_parser(SMOLLM2) is None and detect_parser("") is None
    assert detect_parser(QWEN25 + EXPECTED["mistral"]) is None  # ambiguous: not guessed
    assert detect_parser(MISTRAL_SMALL_32).name == "mistral"


class _Tokenizer:
    def __init__(self, template):
        self.chat_template = template
        self.all_special_ids = []


def test_the_flag_chooses_or_overrides_the_format():
    assert tool_format("auto", _Tokenizer(QWEN25)).name == "hermes"
    assert tool_format("auto", _Tokenizer(SMOLLM2)) is None
    assert tool_format("json", _Tokenizer(QWEN25)) is None  # the JSON format, no parser
    assert tool_format("pythonic", _Tokenizer(SMOLLM2)).name == "pythonic"
    assert tool_format("auto", _Tokenizer({"default": SMOLLM2, "tool_use": QWEN25})).name == "hermes"
    assert parser_name("Qwen3-Coder") == "qwen3_coder" and parser_name("auto") == "auto"
    with pytest.raises(ValidationError, match="--tool-call-parser must be one of"):
        parser_name("hermes2")


def test_serve_flags_reach_the_settings():
    from switchyard.gateway.cli import build_parser
    from switchyard.gateway.serve import server_settings

    args = build_parser({}).parse_args(["serve", "--tool-call-parser", "llama3-json", "--enable-auto-tool-choice"])
    assert server_settings(args).tool_call_parser == "llama3_json"
    assert server_settings(build_parser({}).parse_args(["serve"])).tool_call_parser == "auto"
    from_env = build_parser({"TOOL_CALL_PARSER": "mistral"}).parse_args(["serve"])
    assert server_settings(from_env).tool_call_parser == "mistral"
    with pytest.raises(ValidationError):
        server_settings(build_parser({}).parse_args(["serve", "--tool-call-parser", "nope"]))


def test_auto_selection_tells_glm_from_hermes_and_the_two_deepseek_forms_apart():
    assert detect_parser(GLM45).name == "glm45" and detect_parser(QWEN25).name == "hermes"  # both write <tool_call>
    assert detect_parser(DEEPSEEK_V3).name == "deepseek_v3" and detect_parser(DEEPSEEK_V31).name == "deepseek_v31"
    assert parser_name("deepseek-v31") == "deepseek_v31" and parser_name("GLM45") == "glm45"


# -- DeepSeek ------------------------------------------------------------------------------------------
def test_deepseek_parsers_read_both_forms_and_write_their_own():
    v3, v31 = _parser("deepseek_v3", DEEPSEEK_V3), _parser("deepseek_v31", DEEPSEEK_V31)
    for parser in (v3, v31):
        for name in ("deepseek_v3", "deepseek_v31"):
            text, content = OUTPUTS[name]
            out = parse_output(parser, text)
            assert out.content == content and [(c.name, json.loads(c.arguments)) for c in out.calls] == CALLS
    call = [ToolCall("get_time", '{"tz": "UTC"}')]
    assert "```json" in v3.render(call) and "```json" not in v31.render(call)
    assert v31.render(call) == ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}'
                                '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def test_deepseek_arguments_may_hold_fences_and_a_call_cut_off_keeps_what_was_written():
    parser = _parser("deepseek_v3")
    text = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
            '{"city": "```json\\n```"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert json.loads(parse_output(parser, text).calls[0].arguments) == {"city": "```json\n```"}
    assert _assembled(_run(CallStream(parser), list(text))) == ("", [("get_weather", {"city": "```json\n```"})])
    cut = text[:text.index("json\\n")]
    out = parse_output(parser, cut, cut_off=True)
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city": "```')]


def test_deepseek_templates_that_join_arguments_as_text_get_them_as_text():
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}]
    joined = _parser("deepseek_v3", DEEPSEEK_V3).prepare_messages(history)
    assert joined[0]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'
    assert history[0]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}  # the request's own stay
    assert _parser("deepseek_v3", "{{ tool['function']['arguments'] | tojson }}").prepare_messages(history) == history


# -- Kimi K2 -------------------------------------------------------------------------------------------
def test_kimi_call_ids_are_the_ones_the_model_wrote():
    text, _ = OUTPUTS["kimi_k2"]
    out = parse_output(_parser("kimi_k2"), text)
    assert [c.call_id for c in out.calls] == ["functions.get_weather:0", "functions.get_time:1"]
    stream = CallStream(_parser("kimi_k2"))
    _run(stream, list(text))
    assert (stream.call_id(0), stream.call_id(1), stream.call_id(2)) == ("functions.get_weather:0",
                                                                         "functions.get_time:1", None)
    bare = text.replace("functions.get_time:1", "get_time:1")  # vLLM reads a bare name too
    assert [c.name for c in parse_output(_parser("kimi_k2"), bare).calls] == ["get_weather", "get_time"]


def test_kimi_conversations_carry_ids_in_kimis_shape():
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {}}},
                   {"id": "functions.get_time:7", "type": "function",
                    "function": {"name": "get_time", "arguments": {}}}]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "18"},
               {"role": "tool", "tool_call_id": "functions.get_time:7", "content": "noon"}]
    out = _parser("kimi_k2", KIMI_K2).prepare_messages(history)
    assert [c["id"] for c in out[1]["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:7"]
    assert [m["tool_call_id"] for m in out[2:]] == ["functions.get_weather:0", "functions.get_time:7"]
    assert history[1]["tool_calls"][0]["id"] == "call_abc"


# -- GLM-4.5 -------------------------------------------------------------------------------------------
def test_glm_values_follow_their_schema_types_and_a_call_may_have_no_arguments():
    tool = Tool("f", None, {"type": "object", "properties": {
        "text": {"type": "string"}, "n": {"type": "integer"}, "opts": {"type": "object"}, "flag": {"type": "boolean"},
        "free": {}}})
    parser = ToolFormat(get_parser("glm45"), FormatContext()).for_tools([tool, TIME])
    text = ('<tool_call>f\n<arg_key>text</arg_key>\n<arg_value>42</arg_value>\n<arg_key>n</arg_key>\n<arg_value>7'
            '</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{"a": [1]}</arg_value>\n<arg_key>flag</arg_key>\n'
            '<arg_value>true</arg_value>\n<arg_key>free</arg_key>\n<arg_value>x < y</arg_value>\n</tool_call>')
    call, = parse_output(parser, text).calls
    assert json.loads(call.arguments) == {"text": "42", "n": 7, "opts": {"a": [1]}, "flag": True, "free": "x < y"}
    assert parse_output(parser, "<tool_call>get_time</tool_call>").calls == (ToolCall("get_time", "{}"),)


def test_glm47_writes_no_newlines_and_is_read_the_same():
    compact = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>" \
              "<arg_value>2</arg_value></tool_call>"
    parser = _parser("glm45", "{{ '<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>")
    assert parser.compact and not _parser("glm45", GLM45).compact
    assert [(c.name, json.loads(c.arguments)) for c in parse_output(parser, compact).calls] == CALLS[:1]
    assert parser.render([ToolCall("get_weather", '{"city": "Paris", "days": 2}')]) == compact
    assert _assembled(_run(CallStream(parser), list(compact))) == ("", CALLS[:1])


# -- gpt-oss (harmony) ---------------------------------------------------------------------------------
def test_harmony_calls_read_after_the_reasoning_parser_and_from_the_raw_output():
    parser = _parser("openai", GPT_OSS)
    passed_on = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                 '{"city": "Paris"}<|call|>')  # what gateway/reasoning/harmony.py leaves as the answer
    raw = '<|channel|>analysis<|message|>Need the weather.<|end|>' + passed_on
    for text, content in ((passed_on, None), (raw, "<|channel|>analysis<|message|>Need the weather.<|end|>")):
        out = parse_output(parser, text)
        assert out.content == content and [(c.name, json.loads(c.arguments)) for c in out.calls] == [
            ("get_weather", {"city": "Paris"})]
        assert _assembled(_run(CallStream(parser), list(text))) == (content or "", [("get_weather", {"city": "Paris"})])
    # <|call|> ends generation: a whole body at the end counts without it; the recipient may come first
    for text in (passed_on[:-len("<|call|>")],
                 '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'):
        assert [c.name for c in parse_output(parser, text).calls] == ["get_weather"]
    plain = "<|channel|>final<|message|>It is sunny.<|return|>"  # a message to no function: text
    assert parse_output(parser, plain) == ParsedOutput(plain, ())


def test_a_harmony_call_forced_after_the_final_header_still_reaches_the_parser():
    """Under the gpt_oss reasoning parser a grammar applies after `<|channel|>final<|message|>`:
    a required call is written there, and the reasoning side passes it on as a call."""
    from switchyard.gateway.reasoning.harmony import HarmonySplitter

    text = ('<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|><|channel|>'
            'commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}<|call|>')
    splitter = HarmonySplitter("maybe")
    pieces = [piece for ch in text for piece in splitter.feed(ch)] + splitter.finish()
    answer = "".join(piece for kind, piece in pieces if kind == "content")
    call = ToolCall("get_time", '{"tz": "UTC"}')
    assert parse_output(_parser("openai", GPT_OSS), answer) == ParsedOutput(None, (call,))
