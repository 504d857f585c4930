"""Constrained requests speculate (core/grammar/constrained.py, core/spec/speculator.py): both
matchers roll back; proposals are cut at the first token the grammar rejects or after the one
that completes it, with one mask row per verified position; through EngineCore on a tiny random
Llama (the default tokenizer's vocabulary), greedy JSON-schema and regex requests give the
tokens and finish reasons they give without speculation, with n-gram lookup, with proposals that
the grammar rejects midway, and with a draft model, and nothing leaks."""
import json

import pytest
import torch

from spec_helpers import draft_free_blocks, free_blocks, make_engine, run, save_tiny_llama
from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import GrammarSpec, make_compiler
from switchyard.core.grammar.base import allocate_bitmask
from switchyard.core.grammar.constrained import ConstrainedRequests
from switchyard.core.params import SamplingParams

EOS = 2
VOCAB = 49152
BACKENDS = ["xgrammar", "outlines"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
REGEX = "(yes|no)-[0-9]{2,4}-[a-z]{3,8}"


@pytest.fixture(scope="module", params=BACKENDS)
def compiler(request, default_tokenizer):
    return make_compiler(GrammarConfig(backend=request.param), default_tokenizer, VOCAB, (EOS,))


def _row(matcher):
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


def test_matchers_roll_back_tokens_and_an_accepted_eos(compiler, default_tokenizer):
    ids = default_tokenizer.encode("yes-123-abc", add_special_tokens=False)
    matcher = compiler.compile(GrammarSpec.regex(REGEX)).new_matcher(len(ids) + 1)
    rows = [_row(matcher)]
    for token_id in ids:
        assert matcher.accept_token(token_id)
        rows.append(_row(matcher))
    assert matcher.can_terminate and matcher.accept_token(EOS) and matcher.is_terminated
    matcher.rollback(1)  # the EOS
    assert not matcher.is_terminated and matcher.can_terminate and torch.equal(_row(matcher), rows[-1])
    matcher.rollback(3)
    assert torch.equal(_row(matcher), rows[-4]) and not matcher.can_terminate
    for token_id in ids[-3:]:  # it goes on from there as before
        assert matcher.accept_token(token_id)
    assert torch.equal(_row(matcher), rows[-1])
    matcher.rollback(len(ids))
    assert torch.equal(_row(matcher), rows[0])
    with pytest.raises(ValueError):
        matcher.rollback(1)  # nothing accepted is left


def test_proposals_are_cut_at_a_rejected_token_and_after_completion(compiler, default_tokenizer):
    ids = default_tokenizer.encode("no-42-xyz", add_special_tokens=False)
    requests = ConstrainedRequests(VOCAB, (EOS,), max_rollback_tokens=8)
    requests.add("a", compiler.compile(GrammarSpec.regex(REGEX)))
    first = requests.mask(["a"]).bitmask.clone()
    bad = default_tokenizer.encode("{", add_special_tokens=False)[0]
    assert requests.check_proposals("a", ids[:2] + [bad] + ids[2:]) == ids[:2]
    mask = requests.mask(["b", "a", "a", "a"], {"a": ids[:2]})
    assert mask.rows == (1, 2, 3)
    reference = compiler.compile(GrammarSpec.regex(REGEX)).new_matcher()
    for j, token_id in enumerate([None] + ids[:2]):
        if token_id is not None:
            assert reference.accept_token(token_id)
        assert torch.equal(mask.bitmask[j], _row(reference))  # the row of each verified position
    assert torch.equal(requests.mask(["a"]).bitmask, first)  # rolled back
    # an accepted EOS ends the grammar: nothing after it is verified
    assert requests.check_proposals("a", ids + [EOS, ids[0]]) == ids + [EOS]
    # eight letters complete it: neither EOS nor anything else after them is verified
    full = default_tokenizer.encode("no-42-abcdefgh", add_special_tokens=False)
    assert requests.check_proposals("a", full + [EOS, ids[0]]) == full
    assert requests.feasible_bans("a", (EOS,), 0) == (EOS,)
    assert requests.feasible_bans("a", (EOS,), len(full)) == ()  # only EOS may follow there: grammar wins
    # after sampling: the kept run is cut after the token that completes the grammar
    assert requests.accept_run("a", full + [EOS]) == len(full) and requests.is_complete("a")


def test_a_rejected_kept_token_fails_the_run(compiler, default_tokenizer):
    requests = ConstrainedRequests(VOCAB, (EOS,), max_rollback_tokens=4)
    requests.add("a", compiler.compile(GrammarSpec.regex(REGEX)))
    yes = default_tokenizer.encode("yes", add_special_tokens=False)
    assert requests.accept_run("a", yes + [EOS]) is None


# -- through the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-grammar"), default_tokenizer, vocab_size=VOCAB,
                           eos_token_id=EOS)


def _prompts(tokenizer):
    texts = ['{"name":"abc","ok":true} {"name":"abd","ok":false} {"name":"', "yes-12-abc no-34-def yes-",
             "hello hello hello", "a b c a b c a b"]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec.json_schema(SCHEMA)),
          SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec.regex(REGEX)),
          # EOS pushed hard: min_tokens' ban decides where it may come, at every verified position
          SamplingParams(temperature=0.0, max_tokens=40, min_tokens=6, logit_bias={EOS: 30.0},
                         grammar=GrammarSpec.regex("[a-z ]{1,60}")),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]  # unconstrained beside them


class OracleProposer:
    """Proposes what the request will produce (from a run without speculation), with every
    other proposal run broken at its second token by EOS (which the grammars reject there), and
    runs going on past the output's end: rejections, cuts and full acceptance all happen."""

    def __init__(self, expected: dict[str, list[int]]):
        self.expected = expected
        self.calls = 0

    def propose(self, slots):
        proposals = []
        for request, limit in slots:
            self.calls += 1
            done = len(request.output_token_ids)
            tokens = (self.expected[request.request_id][done:] + [EOS, 7, 7, 7, 7])[:limit]
            if self.calls % 2 and len(tokens) > 1:
                tokens[1] = EOS
            proposals.append(tokens)
        return proposals

    def forget(self, request_id):
        pass


def _check_valid(tokenizer, outputs, reasons):
    text = tokenizer.decode(outputs["r0"])
    assert reasons["r0"].value == "grammar" and set(json.loads(text)) == {"name", "ok"}
    import re

    assert reasons["r1"].value == "grammar" and re.fullmatch(REGEX, tokenizer.decode(outputs["r1"]))
    assert len(outputs["r2"]) >= 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_constrained_greedy_tokens_equal_without_speculation(model_dir, default_tokenizer, backend):
    prompts = _prompts(default_tokenizer)
    expected, _, expected_reasons, _ = run(make_engine(model_dir, grammar_backend=backend), prompts, PARAMS)
    _check_valid(default_tokenizer, expected, expected_reasons)

    ngram = make_engine(model_dir, speculate=4, grammar_backend=backend)
    free = free_blocks(ngram)
    got, _, reasons, _ = run(ngram, prompts, PARAMS)
    assert got == expected and reasons == expected_reasons
    assert ngram.scheduler.speculator.stats.num_cut_by_grammar > 0  # n-gram proposals the grammar refused
    assert free_blocks(ngram) == free and not ngram.constrained

    oracle = make_engine(model_dir, speculate=4, grammar_backend=backend)
    oracle.scheduler.speculator.proposer = OracleProposer(expected)
    got, _, reasons, steps = run(oracle, prompts, PARAMS)
    assert got == expected and reasons == expected_reasons
    stats = oracle.scheduler.speculator.stats
    assert stats.num_cut_by_grammar > 0 and stats.num_accepted > 0.5 * stats.num_proposed
    assert free_blocks(oracle) == free and not oracle.constrained and not oracle.scheduler.speculator._trackers


def test_constrained_requests_with_a_draft_model(model_dir, default_tokenizer):
    prompts = _prompts(default_tokenizer)
    expected, _, expected_reasons, _ = run(make_engine(model_dir), prompts, PARAMS)
    engine = make_engine(model_dir, speculate=3, draft=model_dir)
    free, draft_free = free_blocks(engine), draft_free_blocks(engine)
    got, _, reasons, _ = run(engine, prompts, PARAMS)
    assert got == expected and reasons == expected_reasons
    stats = engine.scheduler.speculator.stats
    assert stats.num_accepted > 0  # the unconstrained request's, at least
    assert free_blocks(engine) == free and draft_free_blocks(engine) == draft_free and not engine.constrained
