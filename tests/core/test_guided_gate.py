"""A grammar that starts after a token sequence (core/grammar/gate.py, gated.py): a reasoning
model thinks freely, and the grammar constrains what follows its end-of-thinking marker.

The matcher on a real compiled grammar (every token allowed before the marker, the grammar's own
rows after it, rollback across it, an optional opener), the constrained requests' speculative
check across it, and the engine end to end on a random-weight model: the tokens before the
marker are the unconstrained run's, the ones after it match the grammar."""
from __future__ import annotations

import pytest
import torch

from switchyard.core import LLM, SamplingParams
from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import GrammarSpec, make_compiler
from switchyard.core.grammar.base import allocate_bitmask, unpack_bitmask
from switchyard.core.grammar.constrained import ConstrainedRequests
from switchyard.core.grammar.gate import GrammarGate
from switchyard.core.grammar.gated import GatedMatcher
from switchyard.core.scheduling.request import FinishReason, Request

EOS = 2
VOCAB = 49152 + 64
DIGITS = GrammarSpec.regex("[0-9]{3}")


@pytest.fixture(scope="module")
def compiled(default_tokenizer):
    return make_compiler(GrammarConfig(), default_tokenizer, VOCAB, (EOS,)).compile(DIGITS)


@pytest.fixture(scope="module")
def ids(default_tokenizer):
    def encode(text: str) -> list[int]:
        return default_tokenizer.encode(text, add_special_tokens=False)
    return encode


def allowed(matcher) -> torch.Tensor:
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, VOCAB)[0]


def test_free_before_the_marker_and_the_grammar_after_it(compiled, ids):
    end = tuple(ids("</think>"))
    assert len(end) > 1  # a marker of several tokens: matched as a sequence
    matcher = GatedMatcher(compiled.new_matcher(8), GrammarGate(end), (EOS,), max_rollback_tokens=8)
    assert bool(allowed(matcher).all())
    for token_id in ids("no digits here, and </thi") + ids("nking"):  # a broken marker is just thinking
        assert matcher.accept_token(token_id)
        assert bool(allowed(matcher).all())
    for token_id in end:
        assert matcher.accept_token(token_id)
    grammar_start = allowed(compiled.new_matcher())
    assert torch.equal(allowed(matcher), grammar_start) and not bool(grammar_start.all())
    letter, = ids("a")
    assert not matcher.accept_token(letter)  # constrained now
    for token_id in ids("12"):
        assert matcher.accept_token(token_id)
    matcher.rollback(2 + len(end))  # back across the marker: free again, the grammar at its start
    assert bool(allowed(matcher).all()) and not matcher.is_terminated
    for token_id in (*end, *ids("589")):
        assert matcher.accept_token(token_id)
    assert matcher.can_terminate and matcher.accept_token(EOS) and matcher.is_terminated


def test_an_optional_opener_thinks_only_when_the_output_opens_with_it(compiled, ids):
    opener, end = tuple(ids("<think>")), tuple(ids("</think>"))
    gate = GrammarGate(end, opener)
    matcher = GatedMatcher(compiled.new_matcher(), gate, (EOS,))
    first = allowed(matcher)
    grammar_start = allowed(compiled.new_matcher())
    assert bool(first[opener[0]]) and not bool(grammar_start[opener[0]])
    assert torch.equal(first & ~_only(opener[0]), grammar_start)  # the grammar's first tokens, and the opener's
    assert matcher.accept_token(opener[0])
    assert torch.equal(allowed(matcher), _only(opener[1]))  # an opener, once begun, is finished
    assert not matcher.accept_token(ids("x")[0])
    for token_id in opener[1:]:
        assert matcher.accept_token(token_id)
    assert bool(allowed(matcher).all())

    answering = GatedMatcher(compiled.new_matcher(), gate, (EOS,))
    assert not answering.accept_token(ids("a")[0])  # no thinking: the grammar from the first token
    assert answering.accept_token(ids("5")[0])
    assert torch.equal(allowed(answering), allowed(_advanced(compiled, ids("5"))))


def test_an_eos_while_thinking_ends_the_output(compiled, ids):
    matcher = GatedMatcher(compiled.new_matcher(), GrammarGate(tuple(ids("</think>"))), (EOS,))
    assert matcher.can_terminate and matcher.accept_token(EOS) and matcher.is_terminated
    assert not matcher.accept_token(ids("1")[0])


def test_constrained_requests_verify_proposals_across_the_marker(compiled, ids):
    end = tuple(ids("</think>"))
    requests = ConstrainedRequests(VOCAB, (EOS,), max_rollback_tokens=16)
    requests.add("r", compiled, GrammarGate(end))
    mask = requests.mask(["r"])
    assert bool(unpack_bitmask(mask.bitmask, VOCAB).all())  # thinking: every token
    thinking = ids("hmm")
    proposals = [*thinking, *end, *ids("1"), *ids("x")]
    kept = requests.check_proposals("r", proposals)
    assert kept == proposals[:-1]  # up to the first token the grammar refuses, after the marker
    assert requests.accept_run("r", kept) == len(kept)
    assert not requests.is_complete("r")
    requests.add("plain", compiled)  # no gate: constrained from the first token
    assert requests.check_proposals("plain", thinking) == []


def test_the_engine_thinks_freely_then_follows_the_grammar():
    with LLM("llama-tiny", load_format="dummy", num_kv_blocks=64) as llm:
        prompt = llm.tokenizer.encode("hello there", add_special_tokens=False)

        def run(request_id: str, params: SamplingParams) -> tuple[list[int], FinishReason]:
            llm.engine.add_request(Request(request_id, prompt, params))
            token_ids, reason = [], None
            while llm.engine.has_unfinished_requests():
                for out in llm.engine.step():
                    assert out.error is None
                    token_ids += out.new_token_ids
                    reason = out.finish_reason
            return token_ids, reason

        free, _ = run("free", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        marker = tuple(free[2:4])  # the greedy run's 3rd and 4th tokens stand for an end-of-thinking marker
        assert not any(free[i:i + 2] == list(marker) for i in range(2))
        constrained, _ = run("constrained", SamplingParams(temperature=0, max_tokens=8, grammar=DIGITS))
        assert constrained[:4] != free[:4]  # the grammar, ungated, bends the first tokens
        gated_digits = DIGITS.gated(GrammarGate(marker))
        gated, reason = run("gated", SamplingParams(temperature=0, max_tokens=12, grammar=gated_digits))
        assert gated[:4] == free[:4]  # unconstrained up to and through the marker
        assert reason is FinishReason.GRAMMAR
        text = llm.tokenizer.decode(gated[4:])
        assert len(text) == 3 and text.isdigit()


def _only(token_id: int) -> torch.Tensor:
    row = torch.zeros(VOCAB, dtype=torch.bool)
    row[token_id] = True
    return row


def _advanced(compiled, token_ids):
    matcher = compiled.new_matcher()
    for token_id in token_ids:
        assert matcher.accept_token(token_id)
    return matcher


def test_a_spent_thinking_budget_forces_the_end_marker(compiled, ids):
    end = tuple(ids("</think>"))
    matcher = GatedMatcher(compiled.new_matcher(8), GrammarGate(end, budget=3), (EOS,), max_rollback_tokens=16)
    thinking = ids("one two three four")
    for token_id in thinking[:3]:
        assert bool(allowed(matcher).all())
        assert matcher.accept_token(token_id)
    for token_id in end:  # spent: only the marker's next token, EOS included in what is refused
        assert torch.equal(allowed(matcher), _only(token_id))
        assert not matcher.accept_token(thinking[3]) and not matcher.accept_token(EOS)
        assert matcher.accept_token(token_id)
    assert torch.equal(allowed(matcher), allowed(compiled.new_matcher()))  # the grammar's, after the marker
    matcher.rollback(len(end) + 1)  # back into the thinking: the budget has one token left again
    assert bool(allowed(matcher).all())
    gate = GrammarGate(end, budget=0)
    assert gate.forced(gate.start()) == end[0]
    early = GatedMatcher(compiled.new_matcher(), GrammarGate(end, budget=50), (EOS,))
    for token_id in (*ids("short"), *end, *ids("123")):  # a model that ends sooner is not touched
        assert early.accept_token(token_id)
    assert early.can_terminate


def test_the_engine_keeps_a_thinking_budget_without_a_grammar():
    with LLM("llama-tiny", load_format="dummy", num_kv_blocks=64) as llm:
        prompt = llm.tokenizer.encode("hello there", add_special_tokens=False)

        def run(request_id: str, params: SamplingParams) -> list[int]:
            llm.engine.add_request(Request(request_id, prompt, params))
            token_ids = []
            while llm.engine.has_unfinished_requests():
                for out in llm.engine.step():
                    assert out.error is None
                    token_ids += out.new_token_ids
            return token_ids

        free = run("free", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        marker = (free[7], free[8]) if free[7] != free[2] else (free[8], free[9])  # an "end marker" it writes late
        budget = GrammarSpec.any_text().gated(GrammarGate(marker, budget=2))
        out = run("budget", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, grammar=budget))
        assert out[:2] == free[:2] and tuple(out[2:4]) == marker  # two free tokens, then the marker, forced
