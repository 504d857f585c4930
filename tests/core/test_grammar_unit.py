"""core/grammar without a model: vocabulary bytes, both compilers' masks, the compile
service (cache, LRU, time limit), constrained-request bookkeeping and the masked sampler."""
import threading
import time

import pytest
import torch

from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import GrammarCompileService, GrammarError, GrammarSpec, make_compiler
from switchyard.core.grammar.base import CompiledGrammar, GrammarCompiler, allocate_bitmask, unpack_bitmask
from switchyard.core.grammar.constrained import ConstrainedRequests, GrammarMask, apply_grammar_mask
from switchyard.core.grammar.vocabulary import token_byte_map, token_bytes
from switchyard.core.params import SamplingParams
from switchyard.core.execution.sampling import Sampler, SampleRow, make_generator

EOS = 2
VOCAB = 49152 + 64  # a logits width past the tokenizer's length: the extra ids are never allowed
BACKENDS = ["xgrammar", "outlines"]


@pytest.fixture(scope="module", params=BACKENDS)
def compiler(request, default_tokenizer):
    return make_compiler(GrammarConfig(backend=request.param), default_tokenizer, VOCAB, (EOS,))


def allowed(matcher) -> set[int]:
    bitmask = allocate_bitmask(2, VOCAB)
    matcher.fill_bitmask(bitmask, 1)
    return set(unpack_bitmask(bitmask, VOCAB)[1].nonzero().flatten().tolist())


def test_token_bytes_of_byte_level_and_byte_fallback_tokens(default_tokenizer):
    assert token_bytes("Ġthe", byte_level=True) == b" the"
    assert token_bytes("Ċ", byte_level=True) == b"\n"
    assert token_bytes("<0x0A>", byte_level=False) == b"\n"
    assert token_bytes("\u2581the", byte_level=False) == b" the"
    mapping = token_byte_map(default_tokenizer, VOCAB)
    ids = {i for ids in mapping.values() for i in ids}
    assert not ids & set(default_tokenizer.all_special_ids)
    text = ' {"name": "Zoë"}\n'
    encoded = default_tokenizer.encode(text, add_special_tokens=False)
    by_id = {i: b for b, ids in mapping.items() for i in ids}
    assert b"".join(by_id[i] for i in encoded) == text.encode()


@pytest.mark.parametrize("spec,text", [
    (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                              "required": ["a", "b"], "additionalProperties": False}), '{"a":12,"b":"y"}'),
    (GrammarSpec.regex(r"\d{4}-\d{2}-\d{2}"), "2024-02-29"),
    (GrammarSpec.regex(r"^[a-z]+@[a-z]+\.com$"), "ann@bake.com"),  # anchors are allowed (outlines strips them)
    (GrammarSpec.json_object(), '{"k":[1,2,{"z":null}]}'),
])
def test_every_token_of_a_valid_text_is_allowed_and_eos_only_at_the_end(compiler, default_tokenizer, spec, text):
    matcher = compiler.compile(spec).new_matcher()
    for token_id in default_tokenizer.encode(text, add_special_tokens=False):
        now = allowed(matcher)
        assert token_id in now and EOS not in now and not matcher.can_terminate
        assert not now & set(range(49152, VOCAB))
        assert matcher.accept_token(token_id)
    assert matcher.can_terminate and EOS in allowed(matcher)
    assert matcher.accept_token(EOS) and matcher.is_terminated


def test_a_token_outside_the_grammar_is_rejected(compiler, default_tokenizer):
    matcher = compiler.compile(GrammarSpec.regex("(yes|no)")).new_matcher()
    assert not matcher.accept_token(default_tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert not matcher.accept_token(EOS)


@pytest.mark.parametrize("spec,param", [
    (GrammarSpec.regex("(unclosed"), "grammar"),
    (GrammarSpec("json_schema", '{"type":"objectx"}'), "response_format"),
    (GrammarSpec("json_schema", '{"type":5}'), "response_format"),
])
def test_invalid_specs_raise_grammar_error_naming_the_parameter(compiler, spec, param):
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec)
    assert info.value.param == param and str(info.value)


class FakeCompiled(CompiledGrammar):
    def __init__(self, spec):
        self.spec = spec

    def new_matcher(self):
        raise NotImplementedError


class FakeCompiler(GrammarCompiler):
    """Compiles instantly, except regexes starting with "slow" (sleeps) or "bad" (fails)."""

    name = "fake"

    def __init__(self, delay_s=1.0):
        self.delay_s = delay_s
        self.calls = []

    def compile(self, spec):
        self.calls.append(spec)
        if spec.value.startswith("slow"):
            time.sleep(self.delay_s)
        if spec.value.startswith("bad"):
            raise GrammarError("bad grammar", "grammar")
        return FakeCompiled(spec)


def test_service_caches_and_evicts_the_least_recently_used():
    fake = FakeCompiler()
    service = GrammarCompileService(lambda: fake, GrammarConfig(cache_size=2))
    a, b, c = (GrammarSpec.regex(x) for x in "abc")
    first = service.compile(a).result(5)
    assert service.compile(a).result(5) is first and (service.num_hits, service.num_misses) == (1, 1)
    service.compile(b).result(5)
    service.compile(a)  # a is now the most recently used
    service.compile(c).result(5)  # evicts b
    assert a in service and c in service and b not in service and len(service) == 2
    service.compile(b).result(5)
    assert fake.calls == [a, b, c, b]


def test_service_errors_are_grammar_errors_and_cached():
    fake = FakeCompiler()
    service = GrammarCompileService(lambda: fake, GrammarConfig())
    for _ in range(2):
        with pytest.raises(GrammarError, match="bad grammar"):
            service.compile(GrammarSpec.regex("bad")).result(5)
    assert len(fake.calls) == 1


def test_a_slow_compile_fails_alone_and_its_late_result_is_never_cached():
    fake = FakeCompiler(delay_s=1.0)
    service = GrammarCompileService(lambda: fake, GrammarConfig(compile_timeout_s=0.2, num_compile_workers=1))
    slow = service.compile(GrammarSpec.regex("slow"))
    quick = service.compile(GrammarSpec.regex("quick"))  # queued behind the slow one on the one slot
    start = time.monotonic()
    with pytest.raises(GrammarError, match="took longer than 0.2 s") as info:
        slow.result(5)
    assert info.value.param == "grammar"
    assert isinstance(quick.result(5), FakeCompiled)
    assert time.monotonic() - start < 0.9  # no wait for the slow one
    assert service.num_timeouts == 1
    time.sleep(1.0)  # the written-off thread finishes: its result is thrown away
    assert GrammarSpec.regex("slow") not in service
    assert service.compile(GrammarSpec.regex("slow")).exception(5) is not None  # compiled afresh (and slow again)
    assert fake.calls.count(GrammarSpec.regex("slow")) == 2


def test_service_is_thread_safe_under_concurrent_callers():
    fake = FakeCompiler()
    service = GrammarCompileService(lambda: fake, GrammarConfig(cache_size=8, num_compile_workers=2))
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(service.compile(GrammarSpec.regex(str(i % 4))).result(5)))
               for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 32 and len(fake.calls) == 4


def test_constrained_requests_mask_only_their_rows_and_keep_bans_feasible(default_tokenizer):
    compiler = make_compiler(GrammarConfig(), default_tokenizer, VOCAB, (EOS,))
    requests = ConstrainedRequests(VOCAB, (EOS,))
    assert requests.mask(["a", "b"]) is None
    requests.add("b", compiler.compile(GrammarSpec.regex("(yes|no)")))
    mask = requests.mask(["a", "b", "c"])
    assert mask.rows == (1,) and mask.bitmask.shape == (1, (VOCAB + 31) // 32)
    yes = default_tokenizer.encode("yes", add_special_tokens=False)
    assert requests.feasible_bans("b", (EOS,)) == (EOS,)
    for token_id in yes:
        assert not requests.is_complete("b")
        assert requests.advance("b", token_id)
    assert requests.is_complete("b")  # only EOS may follow
    assert requests.feasible_bans("b", (EOS, 5)) == ()  # banning EOS would leave nothing: grammar wins
    requests.remove("b")
    assert not requests and requests.mask(["b"]) is None


def test_apply_grammar_mask_touches_only_constrained_rows_and_copies():
    logits = torch.randn(3, 100)
    raw = logits.clone()
    bitmask = torch.zeros(1, 4, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    masked = apply_grammar_mask(logits, GrammarMask((1,), bitmask))
    assert torch.equal(logits, raw)
    assert torch.equal(masked[0], raw[0]) and torch.equal(masked[2], raw[2])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [1, 3]


def test_masked_sampler_samples_allowed_tokens_with_seeds_penalties_and_bias():
    torch.manual_seed(0)
    logits = torch.randn(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 0] = 0b111000  # tokens 3, 4, 5
    params = SamplingParams(temperature=1.0, seed=7, repetition_penalty=1.3, presence_penalty=0.5, top_p=0.9,
                            top_k=20, logit_bias={10: 100.0}, logprobs=2)
    rows = [SampleRow(f"r{i}", params, make_generator(7, torch.device("cpu")), [1, 2, 3], [4, 4])
            for i in range(2)]
    first = Sampler()(logits, rows, GrammarMask((0, 1), bitmask))
    assert all(t in (3, 4, 5) for t in first.token_ids) and first.token_ids[0] == first.token_ids[1]
    rows = [SampleRow(r.request_id, params, make_generator(7, torch.device("cpu")), [1, 2, 3], [4, 4])
            for r in rows]
    assert Sampler()(logits, rows, GrammarMask((0, 1), bitmask)).token_ids == first.token_ids
    raw = torch.log_softmax(logits, -1)
    assert first.logprobs[0] == pytest.approx(raw[0, first.token_ids[0]].item(), abs=1e-5)  # raw distribution


# -- keywords a backend would silently ignore are refused ------------------------------------------
@pytest.mark.parametrize("backend, schema, keyword", [
    ("xgrammar", {"type": "integer", "not": {"const": 3}}, "not"),
    ("xgrammar", {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ("xgrammar", {"type": "string", "pattern": "[a-z]+", "maxLength": 2}, "maxLength"),
    ("xgrammar", {"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf"),
    ("xgrammar", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ("outlines", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}, "minimum"),
    ("outlines", {"type": "object", "$defs": {"x": {"type": "number", "multipleOf": 2}}}, "multipleOf"),
])
def test_keywords_a_backend_would_ignore_are_refused_naming_them(backend, schema, keyword):
    from switchyard.core.grammar.schema_support import (OUTLINES_UNSUPPORTED, XGRAMMAR_UNSUPPORTED,
                                                        check_schema_support)

    unsupported = XGRAMMAR_UNSUPPORTED if backend == "xgrammar" else OUTLINES_UNSUPPORTED
    with pytest.raises(GrammarError, match=f"'{keyword}' .*not supported by the {backend}") as info:
        check_schema_support(GrammarSpec.json_schema(schema), unsupported, backend)
    assert info.value.param == "response_format"


def test_property_names_that_look_like_keywords_and_supported_uses_pass():
    from switchyard.core.grammar.schema_support import XGRAMMAR_UNSUPPORTED, check_schema_support

    schema = {"type": "object", "properties": {"not": {"type": "string", "maxLength": 4},
                                               "if": {"enum": ["not", "uniqueItems"]},
                                               "ids": {"type": "array", "uniqueItems": False}},
              "allOf": [{"$ref": "#/$defs/base"}], "$defs": {"base": {"type": "object"}}}
    check_schema_support(GrammarSpec.json_schema(schema), XGRAMMAR_UNSUPPORTED, "xgrammar")


@pytest.mark.parametrize("pattern,text", [(r"[0-9]+(\.[0-9]+)?", "3.14"), (r"[a-z]+(-[a-z]+)*", "well-known"),
                                          ("(yes|yes!)", "yes!"), (r"[0-9]+(\.[0-9]+)?", "3")])
def test_a_regex_may_go_on_from_an_accepting_state(compiler, default_tokenizer, pattern, text):
    """outlines-core drops the tokens that leave an accepting state one byte late ("." after
    "3"); our sentinel build keeps them, and EOS stays allowed exactly where the regex accepts."""
    matcher = compiler.compile(GrammarSpec.regex(pattern)).new_matcher()
    for token_id in default_tokenizer.encode(text, add_special_tokens=False):
        assert token_id in allowed(matcher) and matcher.accept_token(token_id)
    assert matcher.can_terminate and EOS in allowed(matcher) and matcher.accept_token(EOS)


def test_outlines_core_itself_still_drops_those_tokens(default_tokenizer):
    """The upstream bug the sentinel works around; when this fails, outlines-core fixed it
    and outlines_backend's sentinel can go."""
    import outlines_core

    vocabulary = outlines_core.Vocabulary(EOS, token_byte_map(default_tokenizer, VOCAB))
    index = outlines_core.Index(r"[0-9]+(\.[0-9]+)?", vocabulary)
    three, dot = (default_tokenizer.encode(c, add_special_tokens=False)[0] for c in "3.")
    assert index.get_next_state(index.get_next_state(index.get_initial_state(), three), dot) is None


# -- formats a backend compiles loosely are given their exact pattern -------------------------------
def _format_cases() -> list[tuple[str, str]]:
    dates = [f"{y:04d}-{m:02d}-{d:02d}" for y in (0, 1, 100, 1900, 1996, 2000, 2023, 2024, 9999)
             for m in range(0, 14) for d in range(0, 33)]
    octets = ("0", "00", "01", "9", "10", "99", "100", "199", "200", "249", "250", "255", "256", "300", "010")
    times = ["12:30:00Z", "23:59:59+05:30", "24:00:00Z", "12:30:00", "12:30:00.123Z", "12:60:00Z", "23:59:60Z",
             "07:05:09-24:00", "07:05:09-23:59"]
    return ([("date", s) for s in dates] + [("ipv4", f"{o}.1.22.{o}") for o in octets]
            + [("time", s) for s in times] + [("date-time", f"{d}T{t}") for d in ("2024-02-29", "2023-02-29")
                                                for t in times])


def test_strict_format_patterns_match_exactly_what_json_schema_validators_accept():
    import re

    from jsonschema import Draft202012Validator

    from switchyard.core.grammar.schema_support import STRICT_FORMATS

    checker = Draft202012Validator.FORMAT_CHECKER
    for name, text in _format_cases():
        assert bool(re.fullmatch(STRICT_FORMATS[name], text)) == checker.conforms(text, name), (name, text)


def _accepts(compiler, tokenizer, spec, text) -> bool:
    matcher = compiler.compile(spec).new_matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.can_terminate


@pytest.mark.parametrize("fmt, good, bad", [("ipv4", "192.8.0.181", "192.08.0.181"),
                                            ("date", "2024-02-29", "2023-02-29"),
                                            ("date-time", "2024-04-30T10:00:00Z", "2024-04-31T10:00:00Z"),
                                            ("time", "10:00:00+01:00", "10:00:00")])
def test_both_backends_refuse_what_a_format_forbids(compiler, default_tokenizer, fmt, good, bad):
    """Both backends' own regexes accept "192.08.0.181" and February 31st (outlines' times
    need no offset); the compiled schema holds the format's exact pattern instead."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"v": {"type": "string", "format": fmt}},
                                    "required": ["v"], "additionalProperties": False})
    assert _accepts(compiler, default_tokenizer, spec, f'{{"v":"{good}"}}')
    assert not _accepts(compiler, default_tokenizer, spec, f'{{"v":"{bad}"}}')
