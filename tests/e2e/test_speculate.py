"""Speculative decoding on the default model: input-grounded prompts (rename a variable, copy a
document into JSON) give the same greedy tokens with --speculate as without, most proposals are
accepted, and a batch mixing speculating and plain (sampled, constrained-free) requests is unchanged."""
import pytest

from switchyard.core import LLM, SamplingParams
from switchyard.core.config import SpeculativeConfig

pytestmark = pytest.mark.slow

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
DOC = ("Name: Ada Lovelace\\nBorn: 10 December 1815, London\\nKnown for: the first published computer program, "
       "written for Charles Babbage's Analytical Engine\\nDied: 27 November 1852\\n")
PROMPTS = [
    [{"role": "user", "content": f"Rewrite this code with the variable `subtotal` renamed to `net`:\\n\\n{CODE}"}],
    [{"role": "user", "content": f"Return this document as JSON with the keys name, born, known_for, died:\\n\\n{DOC}"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


class _Without:
    """The engine with its speculator set aside: the same engine, loaded once, with and without
    speculation (two engines may not make the same kernel choices: the CPU backend keeps a bf16
    row copy of the weights only while memory allows). Prefix caching is off, so each run
    computes its prompts the same way."""

    def __init__(self, llm):
        self.llm, self.tokenizer, self.engine = llm, llm.tokenizer, llm.engine

    def __enter__(self):
        self.speculator, self.engine.scheduler.speculator = self.engine.scheduler.speculator, None
        return self

    def __exit__(self, *exc):
        self.engine.scheduler.speculator = self.speculator

    def chat(self, *args, **kwargs):
        return self.llm.chat(*args, **kwargs)


@pytest.fixture(scope="module")
def engines():
    spec = LLM(num_kv_blocks=256, max_num_batched_tokens=512, enable_prefix_caching=False,
               speculative=SpeculativeConfig(num_speculative_tokens=5))
    yield _Without(spec), spec
    spec.shutdown()


def _run(llm, params):
    """Token ids and top log-probabilities of each prompt, all in one batch, through the engine."""
    from switchyard.core.scheduling.request import Request

    for i, messages in enumerate(PROMPTS):
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        llm.engine.add_request(Request(f"g{i}", llm.tokenizer.encode(text, add_special_tokens=False), params))
    tokens = {f"g{i}": [] for i in range(len(PROMPTS))}
    tops = {f"g{i}": [] for i in range(len(PROMPTS))}
    steps = 0
    while llm.engine.has_unfinished_requests():
        steps += 1
        for out in llm.engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            tops[out.request_id].extend(out.top_logprobs or ())
    return list(tokens.values()), list(tops.values()), steps


def test_greedy_tokens_are_those_without_speculation(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=3)
    with plain:
        expected, tops, plain_steps = _run(plain, params)
    got, got_tops, spec_steps = _run(spec, params)
    # exactly, log-probabilities to the bit: a verify's rows are computed as plain decode rows
    # (core/execution/runner.py decodes_by_row), and the CPU kernels give a decode row the same bits
    # whatever rows share its step
    assert got == expected
    assert got_tops == tops
    stats = spec.engine.scheduler.speculator.stats
    assert stats.num_accepted > 0 and spec_steps < plain_steps  # the same tokens in fewer steps
    print(f"speculation: {stats}, {spec_steps} steps against {plain_steps}")


def test_mixed_batch_with_sampling_and_stop_strings(engines):
    plain, spec = engines
    params = [SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.0, max_tokens=60, stop=["}"]),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40)]
    with plain:
        expected = plain.chat(PROMPTS, params)
    got = spec.chat(PROMPTS, params)
    same = 0
    for e, g in zip(expected, got):
        e, g = e.outputs[0], g.outputs[0]
        if g.token_ids == e.token_ids:
            same += 1
            assert g.text == e.text and g.finish_reason == e.finish_reason
        if g.finish_reason.value == "stop_string":
            assert g.text.count("}") == 0 and len(g.token_ids) <= 60
    assert same >= 1
