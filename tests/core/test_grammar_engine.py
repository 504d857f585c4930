"""Constrained requests in the engine and the in-process client on the default model:
GRAMMAR finishes, EOS placement, neighbours unaffected, failures confined to their request."""
import asyncio
import re
import time

import pytest

from switchyard.core import LLM, SamplingParams
from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import GrammarCompileService, GrammarCompiler, GrammarError, GrammarSpec, make_compiler
from switchyard.core.scheduling.request import FinishReason, Request

pytestmark = pytest.mark.slow

YES_NO = GrammarSpec.regex("(yes|no)")


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=512)


def prompt(llm, text="Is water wet? Answer yes or no."):
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def run(engine, requests):
    """Step until done; {request id: (token ids, finish reason, error)}."""
    for request in requests:
        engine.add_request(request)
    results = {r.request_id: ([], None, None) for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, _, _ = results[out.request_id]
            results[out.request_id] = (ids + list(out.new_token_ids), out.finish_reason, out.error)
    return results


def test_a_complete_grammar_finishes_without_an_eos_step(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, grammar=YES_NO)
    ignore = SamplingParams(temperature=0.0, max_tokens=20, grammar=YES_NO, ignore_eos=True, min_tokens=5)
    at_least = SamplingParams(temperature=0.7, seed=1, max_tokens=20, grammar=YES_NO, min_tokens=5)
    results = run(llm.engine, [Request("g1", prompt(llm), params), Request("g2", prompt(llm), ignore),
                               Request("g3", prompt(llm), at_least)])
    for ids, reason, error in results.values():
        assert reason is FinishReason.GRAMMAR and error is None
        assert llm.tokenizer.decode(ids) in ("yes", "no") and 2 not in ids
    assert not llm.engine.constrained  # matchers dropped with their requests


def test_abort_drops_the_matcher_and_the_waiting_request(llm):
    engine = llm.engine
    spec = GrammarSpec.regex("[a-z]{40}")
    engine.add_request(Request("a1", prompt(llm), SamplingParams(max_tokens=30, grammar=spec)))
    engine.add_request(Request("a2", prompt(llm), SamplingParams(max_tokens=30, grammar=GrammarSpec.regex("[0-9]{40}"))))
    engine.finish_request("a2")  # possibly still compiling
    deadline = time.monotonic() + 120  # the first compile starts the worker process
    while "a1" not in engine.constrained and time.monotonic() < deadline:
        engine.step()
    assert "a1" in engine.constrained
    engine.finish_request("a1")
    assert "a1" not in engine.constrained and not engine.has_unfinished_requests()


def test_eos_only_in_accepting_states(llm):
    """EOS pushed hard by logit_bias still waits until the regex can end; then ends as EOS."""
    eos = llm.engine.info.eos_token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 100.0},
                            grammar=GrammarSpec.regex("[a-z]{3,12}"))
    (ids, reason, _), = run(llm.engine, [Request("e1", prompt(llm, "Name a fruit."), params)]).values()
    assert reason is FinishReason.EOS and ids[-1] == eos
    text = llm.tokenizer.decode(ids[:-1])
    assert re.fullmatch("[a-z]{3,12}", text) and len(ids) >= 2


def test_unconstrained_neighbours_get_the_same_tokens(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)]
    alone = llm.generate(["The capital of France is", "Once upon a time"], free)
    constrained = SamplingParams(temperature=0.9, seed=3, max_tokens=40,
                                 grammar=GrammarSpec.json_schema({"type": "object", "properties": {
                                     "city": {"type": "string", "maxLength": 10}}, "required": ["city"]}))
    mixed = llm.generate(["Tell me a city as JSON.", "The capital of France is", "Also JSON please.",
                          "Once upon a time"], [constrained, free[0], constrained, free[1]])
    assert [mixed[1].token_ids, mixed[3].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    assert mixed[0].text.startswith('{"city":"')


def test_offline_generate_raises_the_grammar_error(llm):
    with pytest.raises(GrammarError) as info:
        llm.generate(["Hello", "Hi"], [SamplingParams(max_tokens=4), SamplingParams(
            max_tokens=4, grammar=GrammarSpec.json_schema({"type": "nonsense"}))])
    assert info.value.param == "response_format"
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids  # still serves


class SlowCompiler(GrammarCompiler):
    """The real compiler, but regexes starting with "slow" take `delay_s` first (in a
    thread: it cannot cross to a worker process)."""

    name = "slow"

    def __init__(self, inner, delay_s):
        self.inner, self.delay_s = inner, delay_s

    def compile(self, spec):
        if spec.kind == "regex" and spec.value.startswith("slow"):
            time.sleep(self.delay_s)
        return self.inner.compile(spec)


@pytest.fixture
def client(llm):
    engine = llm.engine
    saved = engine.grammar_service
    config = GrammarConfig(compile_timeout_s=1.0, num_compile_workers=1)
    inner = make_compiler(config, llm.tokenizer, engine.loaded.vocab_size, engine.info.eos_token_ids)
    engine.grammar_service = GrammarCompileService(lambda: SlowCompiler(inner, delay_s=3.0), config)
    client = InProcessEngineClient(lambda: (engine, llm.tokenizer), warm_up=False)
    client.start()
    yield client
    asyncio.run(client.shutdown())
    engine.grammar_service = saved


async def collect(stream):
    outputs = []
    async for out in stream:
        outputs.append((time.monotonic(), out))
    return outputs


def test_client_failures_stay_with_their_request(llm, client):
    async def scenario():
        await client.wait_ready(60)
        with pytest.raises(GrammarError):
            await client.compile_grammar(GrammarSpec.regex("(unclosed"))
        await client.compile_grammar(YES_NO)
        assert YES_NO in client.engine.grammar_service
        ids = prompt(llm)
        free = asyncio.create_task(collect(await client.add_request(
            Request("free", ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))))
        good = asyncio.create_task(collect(await client.add_request(
            Request("good", ids, SamplingParams(max_tokens=8, grammar=YES_NO)))))
        failed_at = {}
        for rid, spec in (("slow", GrammarSpec.regex("slow[a-z]")), ("bad", GrammarSpec.regex("[z-a]"))):
            try:
                stream = await client.add_request(Request(rid, ids, SamplingParams(max_tokens=8, grammar=spec)))
                await collect(stream)
            except GrammarError as exc:
                failed_at[rid] = (time.monotonic(), str(exc))
        free_outputs, good_outputs = await free, await good
        return failed_at, free_outputs, good_outputs

    failed_at, free_outputs, good_outputs = asyncio.run(scenario())
    assert "took longer than 1 s" in failed_at["slow"][1] and "bad" in failed_at
    assert good_outputs[-1][1].finish_reason is FinishReason.GRAMMAR
    assert len(free_outputs) == 24 and free_outputs[-1][1].finish_reason is FinishReason.LENGTH
    assert free_outputs[0][0] < failed_at["slow"][0]  # it generated while the slow grammar compiled
