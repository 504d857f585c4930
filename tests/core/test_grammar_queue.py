"""The compile queue (core/grammar/service.py): the slots for any size and the warm spare for
small and medium specs, the default number of workers, what is never cached (a server-side failure),
and schemas with no finite instance (core/grammar/finite.py) refused before any compile.
In-thread fake compilers: the bookkeeping, not a compiler's speed (the real workers are in
test_grammar_isolation.py, the heavy schemas through a server in
tests/gateway/test_reliability_leftovers.py)."""
import threading
import time

import pytest

from switchyard.core.config import GrammarConfig, default_compile_workers
from switchyard.core.grammar import GrammarCompileService, GrammarError, GrammarSpec, GrammarUnavailable
from switchyard.core.grammar.base import CompiledGrammar, GrammarCompiler
from switchyard.core.grammar.finite import check_finite

HEAVY = "wait" + "x" * (100 << 10)  # larger than the spare takes
MEDIUM = "[a-z]+" + "x" * (18 << 10)  # the issue's 18 KB schema: more than a small spec's 16 KiB


class _Compiled(CompiledGrammar):
    def new_matcher(self):
        raise NotImplementedError


class BlockingCompiler(GrammarCompiler):
    """A regex starting "wait" blocks until `release` is set; any other compiles at once."""

    name = "blocking"

    def __init__(self):
        self.calls: list[str] = []
        self.release = threading.Event()

    def compile(self, spec):
        self.calls.append(spec.value)
        if spec.value.startswith("wait"):
            self.release.wait(30)
        return _Compiled()


def _running(fake: BlockingCompiler, count: int, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while sum(v.startswith("wait") for v in fake.calls) < count:
        assert time.monotonic() < deadline, fake.calls
        time.sleep(0.01)


def test_a_small_spec_is_compiled_on_the_spare_while_heavy_ones_hold_every_slot():
    fake = BlockingCompiler()
    service = GrammarCompileService(lambda: fake, GrammarConfig(num_compile_workers=2))
    try:
        heavy = [service.compile(GrammarSpec.regex(HEAVY + "1")), service.compile(GrammarSpec.regex(HEAVY + "2"))]
        _running(fake, 2)  # both slots are busy
        start = time.monotonic()
        service.compile(GrammarSpec.regex("[a-z]+")).result(5)
        assert time.monotonic() - start < 1 and not any(f.done() for f in heavy)
        third = service.compile(GrammarSpec.regex(HEAVY + "3"))  # too large for the spare: it waits
        time.sleep(0.3)
        assert HEAVY + "3" not in fake.calls and not third.done()
        fake.release.set()
        for future in (*heavy, third):
            future.result(5)
    finally:
        fake.release.set()
        service.shutdown()


def test_a_medium_spec_is_compiled_on_the_spare_while_heavy_ones_hold_every_slot():
    fake = BlockingCompiler()
    service = GrammarCompileService(lambda: fake, GrammarConfig(num_compile_workers=2))
    try:
        heavy = [service.compile(GrammarSpec.regex(HEAVY + "1")), service.compile(GrammarSpec.regex(HEAVY + "2"))]
        _running(fake, 2)  # both slots are busy
        medium = service.compile(GrammarSpec.regex(MEDIUM))
        medium.result(5)
        assert not any(f.done() for f in heavy)
    finally:
        fake.release.set()
        service.shutdown()


def test_without_a_spare_a_small_spec_waits_for_a_slot():
    """The control of the test above: the same queue with the spare turned off."""
    fake = BlockingCompiler()
    service = GrammarCompileService(lambda: fake, GrammarConfig(num_compile_workers=2, spare_max_spec_bytes=0))
    try:
        service.compile(GrammarSpec.regex(HEAVY + "1"))
        service.compile(GrammarSpec.regex(HEAVY + "2"))
        _running(fake, 2)
        small = service.compile(GrammarSpec.regex("[a-z]+"))
        time.sleep(0.3)
        assert not small.done()
        fake.release.set()
        small.result(5)
    finally:
        fake.release.set()
        service.shutdown()


def test_the_default_is_two_workers_where_there_are_two_cores(monkeypatch):
    """Counted from the CPUs the machine offers (placement.py), or those the engine was given;
    a bound thread's mask: tests/core/test_grammar_workers.py."""
    from switchyard.core.grammar import placement

    monkeypatch.setattr(placement, "offered_cpus", lambda: frozenset({0, 1, 2, 3}))
    assert default_compile_workers() == 2 and GrammarConfig().compile_workers == 2
    assert GrammarConfig().compile_workers_on((5,)) == 1
    monkeypatch.setattr(placement, "offered_cpus", lambda: frozenset({0}))
    assert default_compile_workers() == 1 and GrammarConfig().compile_workers == 1
    assert GrammarConfig(num_compile_workers=3).compile_workers == 3


def test_a_compiler_that_cannot_start_is_unavailable_and_not_cached():
    fake = BlockingCompiler()
    attempts = []

    def make():
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("no memory for the tokenizer tables")
        return fake

    spec = GrammarSpec.json_schema({"type": "object"})
    service = GrammarCompileService(make, GrammarConfig(num_compile_workers=1, spare_max_spec_bytes=0))
    try:
        with pytest.raises(GrammarUnavailable, match="could not start: no memory") as failed:
            service.compile(spec).result(5)
        assert isinstance(failed.value, GrammarError) and failed.value.param == "response_format"
        assert spec not in service
        service.compile(spec).result(5)  # compiled afresh, not the cached failure
        assert fake.calls == [spec.value]
    finally:
        service.shutdown()


def test_a_shut_down_service_is_unavailable():
    service = GrammarCompileService(BlockingCompiler, GrammarConfig())
    service.shutdown()
    with pytest.raises(GrammarUnavailable, match="shut down"):
        service.compile(GrammarSpec.regex("[a-z]")).result(0)


ENDLESS = [
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # an object by its keywords
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2},
    {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
               "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
     "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]},
]
FINITE = [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # `next` may be left out
    {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # null ends it
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}]},
    {"$defs": {"node": {"type": "object", "required": ["value", "children"], "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}, "required": ["x"]},  # the compiler's to report
    {"type": "array", "items": {"type": "string"}, "minItems": 10 ** 12},
]


@pytest.mark.parametrize("schema", ENDLESS)
def test_a_schema_that_recurses_without_end_is_refused(schema):
    with pytest.raises(GrammarError, match=r"no finite instance.*through \$ref") as refused:
        check_finite(GrammarSpec.json_schema(schema))
    assert refused.value.param == "response_format" and not isinstance(refused.value, GrammarUnavailable)


@pytest.mark.parametrize("schema", FINITE)
def test_a_recursive_schema_that_can_end_passes(schema):
    check_finite(GrammarSpec.json_schema(schema))


def test_the_service_refuses_an_endless_schema_without_compiling_it_and_caches_the_refusal():
    fake = BlockingCompiler()
    service = GrammarCompileService(lambda: fake, GrammarConfig())
    try:
        spec = GrammarSpec.json_schema(ENDLESS[0])
        with pytest.raises(GrammarError, match="no finite instance"):
            service.compile(spec).result(5)
        assert fake.calls == [] and spec in service
    finally:
        service.shutdown()
