"""`tool_choice: required` and named in a model's own format: each parser's grammar, compiled by
the real grammar backends over the default model's vocabulary, accepts a valid call in that
format (which its parser reads back) and refuses an invalid one: another function, arguments
against the schema, a missing marker, a second call where one is allowed. Markers that are
special tokens (Mistral's) are required as those tokens; outlines-core, which cannot, says so."""
from __future__ import annotations

import copy
import json

import pytest
from tool_templates import MISTRAL_SMALL_32

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
}
TWO = {"mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","days":2}},'
                  '{"name":"get_time","arguments":{"tz":"UTC"}}]',
       "pythonic": '[get_weather(city="Paris", days=2), get_time(tz="UTC")]'}


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
    return ["xgrammar"] if name == "qwen3_coder" else ["xgrammar", "outlines"]  # qwen_xml: xgrammar's own


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
                           "</tool_call>"}[name]
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


def test_outlines_says_qwen3_coder_needs_xgrammar(compilers):
    with pytest.raises(GrammarError, match="xgrammar"):
        compilers["outlines"].compile(_spec(_parser("qwen3_coder"), [WEATHER], parallel=False))


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
