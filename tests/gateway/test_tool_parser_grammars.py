"""`tool_choice: required` and named in a model's own format: each parser's grammar, compiled by
the real grammar backends over the default model's vocabulary, accepts a valid call in that
format (which its parser reads back) and refuses an invalid one: another function, arguments
against the schema, a missing marker, a second call where one is allowed. Markers that are
special tokens (Mistral's, DeepSeek's, Kimi K2's, GLM's, harmony's) are required as those tokens;
outlines-core, which cannot, says so."""
from __future__ import annotations

import copy
import json

import pytest
from tool_templates import GLM45, MISTRAL_SMALL_32

from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import GrammarError, GrammarSpec, make_compiler
from switchyard.core.grammar.finite import check_finite
from switchyard.gateway.openai.tools import Tool
from switchyard.gateway.tool_parsers import FormatContext, ToolFormat, get_parser, parse_output

EOS = 2
WEATHER = Tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"},
                                                                      "days": {"type": "integer"}},
                                     "required": ["city"], "additionalProperties": False})
TIME = Tool("get_time", None, {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
                               "additionalProperties": False})
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})]

# format -> (template, one call as the grammar writes it, the second call, how two are joined,
#            invalid texts: another function, a wrong argument, no marker)
FORMATS = {
    "hermes": ("", '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":2}}\n</tool_call>',
               '<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>', "\n",
               ['<tool_call>\n{"name":"get_wether","arguments":{"city":"Paris"}}\n</tool_call>',
                '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":"two"}}\n</tool_call>',
                '{"name":"get_weather","arguments":{"city":"Paris"}}']),
    "llama3_json": ("", '{"name":"get_weather","parameters":{"city":"Paris","days":2}}',
                    '{"name":"get_time","parameters":{"tz":"UTC"}}', "; ",
                    ['{"name":"get_wether","parameters":{"city":"Paris"}}',
                     '{"name":"get_weather","parameters":{"days":2}}',
                     '{"name":"get_weather","arguments":{"city":"Paris"}}']),
    "mistral": ("", '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","days":2}}]',
                None, None,
                ['[TOOL_CALLS][{"name":"get_wether","arguments":{"city":"Paris"}}]',
                 '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","extra":1}}]',
                 '[{"name":"get_weather","arguments":{"city":"Paris"}}]']),
    "pythonic": ("", '[get_weather(city="Paris", days=2)]', None, None,
                 ['[get_wether(city="Paris")]', '[get_weather(days=2)]', 'get_weather(city="Paris")']),
    "qwen3_coder": ("", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>",
                    "\n",
                    ["<tool_call>\n<function=get_wether>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                     "</tool_call>",
                     "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n"
                     "</tool_call>",
                     "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"]),
    "deepseek_v3": ("", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                        '{"city":"Paris","days":2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, None,
                    ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_wether\n```json\n{"city":"Paris"}'
                     '\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"days":2}\n```'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                     '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city":"Paris"}\n```'
                     '<｜tool▁call▁end｜>']),
    "deepseek_v31": ("", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris","days":2}'
                         '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, None,
                     ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_wether<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>'
                      '<｜tool▁calls▁end｜>',
                      '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris","days":"2"}'
                      '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                      '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>']),
    "kimi_k2": ("", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                    '{"city":"Paris","days":2}<|tool_call_end|><|tool_calls_section_end|>', None, None,
                ['<|tool_calls_section_begin|><|tool_call_begin|>functions.get_wether:0<|tool_call_argument_begin|>'
                 '{"city":"Paris"}<|tool_call_end|><|tool_calls_section_end|>',
                 '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                 '{"city":"Paris","extra":1}<|tool_call_end|><|tool_calls_section_end|>',
                 '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Paris"}'
                 '<|tool_call_end|>']),
    "glm45": (GLM45, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                     "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
              "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>", "\n",
              ["<tool_call>get_wether\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
               "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
               "\n<arg_value>two</arg_value>\n</tool_call>",
               "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"]),
    "openai": ("", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                   '{"city":"Paris","days":2}<|call|>',
               '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz":"UTC"}<|call|>',
               "<|start|>assistant",
               ['<|channel|>commentary to=functions.get_wether <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"days":2}<|call|>',
                '{"city":"Paris"}']),
}
TWO = {"mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","days":2}},'
                  '{"name":"get_time","arguments":{"tz":"UTC"}}]',
       "pythonic": '[get_weather(city="Paris", days=2), get_time(tz="UTC")]',
       "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                      '{"city":"Paris","days":2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time'
                      '\n```json\n{"tz":"UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
       "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris","days":2}'
                       '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz":"UTC"}<｜tool▁call▁end｜>'
                       '<｜tool▁calls▁end｜>',
       "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                  '{"city":"Paris","days":2}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
                  '<|tool_call_argument_begin|>{"tz":"UTC"}<|tool_call_end|><|tool_calls_section_end|>'}


@pytest.fixture(scope="module")
def compilers(default_tokenizer):
    vocab = len(default_tokenizer)
    return {backend: make_compiler(GrammarConfig(backend=backend), default_tokenizer, vocab, (EOS,))
            for backend in ("xgrammar", "outlines")}


def _parser(name: str, template: str = "", special: frozenset[str] = frozenset()):
    return ToolFormat(get_parser(name), FormatContext(template, special)).for_tools([WEATHER, TIME])


def _accepts(compiled, token_ids: list[int]) -> bool:
    matcher = compiled.new_matcher()
    return all(matcher.accept_token(token_id) for token_id in token_ids) and matcher.can_terminate


def _spec(parser, tools, parallel) -> GrammarSpec:
    return GrammarSpec.structural(parser.grammar(tools, parallel))


def _backends(name: str) -> list[str]:
    return ["xgrammar"] if name in ("qwen3_coder", "glm45") else ["xgrammar", "outlines"]  # XML styles: xgrammar's


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_required_accepts_valid_calls_in_the_format_and_refuses_invalid_ones(compilers, default_tokenizer, name):
    template, one, second, joint, invalid = FORMATS[name]
    parser = _parser(name, template)
    two = TWO.get(name) or one + joint + second
    for backend in _backends(name):
        compiled = compilers[backend].compile(_spec(parser, [WEATHER, TIME], parallel=True))
        encode = lambda text: default_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        assert _accepts(compiled, encode(one)), (backend, one)
        assert _accepts(compiled, encode(two)), (backend, two)
        for text in invalid:
            assert not _accepts(compiled, encode(text)), (backend, text)
        single = compilers[backend].compile(_spec(parser, [WEATHER, TIME], parallel=False))
        assert _accepts(single, encode(one)) and not _accepts(single, encode(two)), backend
    # what the grammar lets through is what the parser reads
    assert [(c.name, json.loads(c.arguments)) for c in parse_output(parser, two).calls] == CALLS


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_named_choice_allows_that_function_only(compilers, default_tokenizer, name):
    template, one, _, _, _ = FORMATS[name]
    compiled = compilers["xgrammar"].compile(_spec(_parser(name, template), [TIME], parallel=False))
    assert not _accepts(compiled, default_tokenizer.encode(one, add_special_tokens=False))
    text = {"hermes": '<tool_call>\n{"name":"get_time","arguments":{"tz":"CET"}}\n</tool_call>',
            "llama3_json": '{"name":"get_time","parameters":{"tz":"CET"}}',
            "mistral": '[TOOL_CALLS][{"name":"get_time","arguments":{"tz":"CET"}}]',
            "pythonic": '[get_time(tz="CET")]',
            "qwen3_coder": "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n"
                           "</tool_call>",
            "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz":"CET"}'
                           '\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz":"CET"}<｜tool▁call▁end｜>'
                            '<｜tool▁calls▁end｜>',
            "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>'
                       '{"tz":"CET"}<|tool_call_end|><|tool_calls_section_end|>',
            "glm45": "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>",
            "openai": ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz":"CET"}'
                       '<|call|>')}[name]
    assert _accepts(compiled, default_tokenizer.encode(text, add_special_tokens=False)), text


@pytest.fixture(scope="module")
def mistral_tokenizer(default_tokenizer):
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    return tokenizer


def test_mistral_markers_that_are_special_tokens_are_required_as_tokens(mistral_tokenizer):
    special = frozenset({"[TOOL_CALLS]", "[ARGS]"})
    parser = _parser("mistral", MISTRAL_SMALL_32, special)
    spec = _spec(parser, [WEATHER, TIME], parallel=True)
    assert '"type":"token"' in spec.value
    compiler = make_compiler(GrammarConfig(), mistral_tokenizer, len(mistral_tokenizer), (EOS,))
    compiled = compiler.compile(spec)
    call = '[TOOL_CALLS]get_weather[ARGS]{"city":"Paris","days":2}'
    ids = mistral_tokenizer.encode(call, add_special_tokens=False)
    assert mistral_tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") == ids[0]  # one token
    assert _accepts(compiled, ids)
    assert _accepts(compiled, mistral_tokenizer.encode(call + '[TOOL_CALLS]get_time[ARGS]{"tz":"UTC"}',
                                                       add_special_tokens=False))
    spelled = [i for piece in ("[", "TOOL", "_CALLS", "]") for i in mistral_tokenizer.encode(
        piece, add_special_tokens=False)] + mistral_tokenizer.encode(call[len("[TOOL_CALLS]"):],
                                                                     add_special_tokens=False)
    assert not _accepts(compiled, spelled)  # the marker spelled out in text is no marker
    outlines = make_compiler(GrammarConfig(backend="outlines"), mistral_tokenizer, len(mistral_tokenizer), (EOS,))
    with pytest.raises(GrammarError, match="xgrammar") as refused:
        outlines.compile(spec)
    assert refused.value.param == "tools"


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
def test_outlines_says_xml_parameters_need_xgrammar(compilers, name):
    with pytest.raises(GrammarError, match="xgrammar"):
        compilers["outlines"].compile(_spec(_parser(name), [WEATHER], parallel=False))


# format -> its markers that are special tokens in its models, and one call with them
SPECIAL = {
    "deepseek_v31": (("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                      "<｜tool▁sep｜>"),
                     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz":"UTC"}<｜tool▁call▁end｜>'
                     '<｜tool▁calls▁end｜>'),
    "kimi_k2": (("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
                '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:12<|tool_call_argument_begin|>'
                '{"tz":"UTC"}<|tool_call_end|><|tool_calls_section_end|>'),
    "openai": (("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>"),
               '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz":"UTC"}<|call|>'),
}


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_markers_that_are_special_tokens_are_required_as_tokens(default_tokenizer, name):
    markers, call = SPECIAL[name]
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(markers)})
    parser = _parser(name, "", frozenset(markers))
    assert parser.keeps_special_tokens
    spec = _spec(parser, [WEATHER, TIME], parallel=True)
    compiled = make_compiler(GrammarConfig(), tokenizer, len(tokenizer), (EOS,)).compile(spec)
    ids = tokenizer.encode(call, add_special_tokens=False)
    assert _accepts(compiled, ids), call
    assert tokenizer.convert_tokens_to_ids(markers[1] if name == "openai" else markers[0]) == ids[0]
    spelled = [i for piece in (call[:2], call[2:]) for i in tokenizer.encode(piece, add_special_tokens=False)]
    assert not _accepts(compiled, spelled)  # the first marker spelled out in text is no marker
    assert [c.name for c in parse_output(parser, call).calls] == ["get_time"]


def test_tool_schemas_in_a_grammar_are_checked_as_any_schema(compilers, default_tokenizer):
    looping = Tool("loop", None, {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]})
    with pytest.raises(GrammarError, match="no finite instance"):
        check_finite(_spec(_parser("hermes"), [looping], parallel=False))
    negated = Tool("neg", None, {"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(GrammarError, match="'not'") as refused:
        compilers["xgrammar"].compile(_spec(_parser("hermes"), [negated], parallel=False))
    assert refused.value.param == "tools"
    nested = Tool("nested", None, {"type": "object", "properties": {"inner": {"$ref": "#/$defs/Inner"}},
                                   "required": ["inner"], "$defs": {"Inner": {"type": "object", "properties": {
                                       "x": {"type": "integer"}}, "required": ["x"]}}})
    for name, text in (("hermes", '<tool_call>\n{"name":"nested","arguments":{"inner":{"x":1}}}\n</tool_call>'),
                       ("pythonic", '[nested(inner={"x":1})]')):
        compiled = compilers["xgrammar"].compile(_spec(_parser(name), [nested], parallel=False))
        assert _accepts(compiled, default_tokenizer.encode(text, add_special_tokens=False)), name


@pytest.mark.parametrize("tree", [{"type": "bogus"}, {"type": "const_string", "value": ""},
                                  {"type": "sequence", "elements": []}, {"type": "star"},
                                  {"type": "json_schema", "json_schema": {}, "style": "yaml"}])
def test_a_malformed_structural_grammar_is_refused_by_both_backends(compilers, tree):
    for compiler in compilers.values():
        with pytest.raises(GrammarError, match="structural grammar"):
            compiler.compile(GrammarSpec.structural(tree))
