"""Prefix caching on the default model: a repeated long prefix is served from the cache
(fewer tokens computed) with the same greedy output as the cold run."""
import pytest

from switchyard.core import LLM, SamplingParams

pytestmark = pytest.mark.slow

PREFIX = ("You are a careful assistant for a railway company. Answer in one short sentence, name the "
          "station or the line when you can, and never invent timetables. Stations: Northgate, Millbrook, "
          "Harbourside, Old Quarry, Elm Park and Central. Lines: Red (Northgate to Central), Blue (Millbrook "
          "to Harbourside), Green (Old Quarry to Elm Park). ")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_kv_blocks=256, max_num_batched_tokens=512)
    computed = []
    execute = llm.engine.runner.execute

    def counting_execute(scheduler_output):
        computed.append(scheduler_output.num_batched_tokens)
        return execute(scheduler_output)

    llm.engine.runner.execute = counting_execute
    llm.computed = computed
    return llm


def _generate(llm, prompt, params=GREEDY):
    llm.computed.clear()
    results = llm.generate(prompt, params)
    return results[0], sum(llm.computed)


def test_a_repeated_long_prefix_is_served_from_the_cache(llm):
    prompt = PREFIX + "Question: which line goes to Harbourside?"
    num_prompt = len(llm.tokenizer.encode(prompt))
    assert num_prompt > 64
    cold, computed_cold = _generate(llm, prompt)
    warm, computed_warm = _generate(llm, prompt)
    assert warm.token_ids == cold.token_ids and warm.text == cold.text
    num_cached = (num_prompt - 1) // 16 * 16
    assert computed_cold == num_prompt + 5 and computed_warm == computed_cold - num_cached

    other = PREFIX + "Question: where does the Green line start?"
    _, computed_other = _generate(llm, other)
    num_other = len(llm.tokenizer.encode(other))
    assert computed_other <= num_other + 5 - 64  # at least the prefix's first 4 blocks were reused

    # n samples of one prompt share its blocks: the prompt is computed once, not three times
    siblings, computed_siblings = _generate(llm, PREFIX + "Question: name a station.",
                                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3))
    num_siblings = len(llm.tokenizer.encode(PREFIX + "Question: name a station."))
    assert len({o.token_ids for o in siblings.outputs}) == 1
    assert computed_siblings < num_siblings + 2 * 16 + 3 * 5
