"""Speculative decoding on the default model with a draft model and with grammars: the default
model as its own draft (--speculative-model) gives the greedy tokens of plain decoding with
nearly every proposal accepted, and a document extracted into JSON under a schema (the
input-grounded case n-gram lookup is for) gives the same JSON with n-gram proposals and with
the draft, the grammar cutting the proposals it refuses."""
import json

import pytest

from switchyard.core import LLM, SamplingParams
from switchyard.core.config import SpeculativeConfig
from switchyard.core.grammar import GrammarSpec

pytestmark = pytest.mark.slow

DOC = ("Name: Ada Lovelace\\nBorn: 10 December 1815, London\\nKnown for: the first published computer program, "
       "written for Charles Babbage's Analytical Engine\\nDied: 27 November 1852\\n")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "string"},
                                           "known_for": {"type": "string"}, "died": {"type": "string"}},
          "required": ["name", "born", "known_for", "died"]}
PROMPTS = [
    [{"role": "user",
      "content": f"Return this document as JSON with the keys name, born, known_for, died:\\n\\n{DOC}"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "List three colours, one per line."}],
]


NEAR_TIE = 0.05  # log-probability gap under which two tokens are a tie for differently composed batches


@pytest.fixture(scope="module")
def engines():
    from switchyard.core.loader import default_model_path

    options = {"num_kv_blocks": 256, "max_num_batched_tokens": 512}
    llms = {"plain": LLM(**options),
            "ngram": LLM(**options, speculative=SpeculativeConfig(num_speculative_tokens=5)),
            "draft": LLM(**options, speculative=SpeculativeConfig(num_speculative_tokens=4, method="draft",
                                                                  draft_model=default_model_path()))}
    yield llms
    for llm in llms.values():
        llm.shutdown()


def _run(llm, params):
    """Token ids and top log-probabilities of each prompt, all in one batch, through the engine."""
    from switchyard.core.scheduling.request import Request

    params = params if isinstance(params, list) else [params] * len(PROMPTS)
    for i, (messages, p) in enumerate(zip(PROMPTS, params)):
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        llm.engine.add_request(Request(f"d{i}", llm.tokenizer.encode(text, add_special_tokens=False), p))
    tokens = {f"d{i}": [] for i in range(len(PROMPTS))}
    tops = {f"d{i}": [] for i in range(len(PROMPTS))}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.error is None
            tokens[out.request_id].extend(out.new_token_ids)
            tops[out.request_id].extend(out.top_logprobs or ())
    return list(tokens.values()), list(tops.values())


def _same_greedy(got, expected, expected_top):
    """Equal, or equal up to a position where the plain run's top two tokens were a near-tie.
    Decode rows are computed alike whatever shares their step, prompt chunks are not: a batch
    composed otherwise (a grammar still compiling holds its request back in a first run, a
    cached prefix shortens a chunk) computes a prompt's keys and values with other rounding, even
    in the same engine without speculation."""
    if got == expected:
        return True
    index = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    top = dict(expected_top[index])
    return got[index] in top and top[expected[index]] - top[got[index]] < NEAR_TIE


def test_the_model_as_its_own_draft_gives_its_greedy_tokens(engines):
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=3)
    expected, tops = _run(engines["plain"], params)
    got, _ = _run(engines["draft"], params)
    for g, e, top in zip(got, expected, tops):
        assert _same_greedy(g, e, top)
    stats = engines["draft"].engine.scheduler.speculator.stats
    assert stats.num_accepted > 0.9 * stats.num_proposed  # it proposes what it will sample
    proposer = engines["draft"].engine.scheduler.speculator.proposer
    assert proposer.num_sequences == 0 and proposer.kv_cache_manager.block_pool.usage == 0.0
    print(f"draft: {stats}")


def test_json_under_a_schema_is_the_same_with_ngram_and_draft_proposals(engines):
    params = [SamplingParams(temperature=0.0, max_tokens=96, logprobs=3, grammar=GrammarSpec.json_schema(SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=32, logprobs=3,
                             grammar=GrammarSpec.regex("[A-Z][a-z ,]{5,80}\\.")),
              SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)]
    expected, tops = _run(engines["plain"], params)
    document = json.loads(engines["plain"].tokenizer.decode(expected[0]))
    assert document["name"] == "Ada Lovelace"
    for name in ("ngram", "draft"):
        got, _ = _run(engines[name], params)
        for g, e, top in zip(got, expected, tops):
            assert _same_greedy(g, e, top), name
        stats = engines[name].engine.scheduler.speculator.stats
        assert stats.num_accepted > 0 and stats.num_cut_by_grammar > 0, (name, stats)
        assert not engines[name].engine.constrained
        print(f"{name}: {stats}")


def test_serve_refuses_a_draft_without_the_models_tokenizer_in_one_line(tmp_path, default_tokenizer):
    """Checked with the model, before the server reports it (exit 2, as any configuration error)."""
    import subprocess
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "core"))
    from spec_helpers import save_tiny_llama

    draft = save_tiny_llama(tmp_path / "draft", default_tokenizer)  # 96 tokens, not the model's 49152
    result = subprocess.run([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", "0",
                             "--speculative-model", draft, "--max-batch-total-tokens", "2048"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--speculative-model" in result.stderr and "vocabulary has 96 tokens" in result.stderr
