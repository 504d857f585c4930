"""Speculative decoding (core/spec) through EngineCore on a tiny random Llama and the real CPU
backend: the tokens (greedy, and seeded sampling, which is rewound to the draws it keeps) are
those of the same engine without speculation, through mixed batches, preemption, prefix caching,
stops, penalties, logprobs and abort, and no KV block leaks."""
import pytest

from switchyard.core.params import SamplingParams

from spec_helpers import free_blocks as _free_blocks, make_engine, run, save_tiny_llama


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec"), default_tokenizer)


# Repetitive prompts (the tiny model's greedy continuations also fall into loops), so n-gram
# lookup proposes often and both acceptance and rejection happen.
PROMPTS = [[1, 5, 9, 13, 17, 5, 9, 13, 17, 5, 9], [1, 7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6],
           [1] + [40, 41, 42, 43, 44] * 6, [1, 80, 81, 82, 80, 81, 82, 80]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_greedy_tokens_equal_without_speculation_and_proposals_are_accepted(tiny_model_dir):
    plain = make_engine(tiny_model_dir)
    spec = make_engine(tiny_model_dir, speculate=4)
    free = _free_blocks(spec)
    expected, _, _, plain_steps = run(plain, PROMPTS, GREEDY)
    got, _, _, spec_steps = run(spec, PROMPTS, GREEDY)
    assert got == expected
    stats = spec.scheduler.speculator.stats
    assert stats.num_proposed > 0 and 0 < stats.num_accepted < stats.num_proposed  # both outcomes seen
    assert spec_steps < plain_steps
    assert _free_blocks(spec) == free  # every block back (cached ones are free, evictable)


def test_greedy_equal_under_preemption_without_prefix_caching_and_small_budget(tiny_model_dir):
    expected, _, _, _ = run(make_engine(tiny_model_dir), PROMPTS, GREEDY)
    tight = make_engine(tiny_model_dir, speculate=5, num_blocks=30, prefix_caching=False, budget=24)
    got, _, _, _ = run(tight, PROMPTS, GREEDY)
    assert got == expected
    assert tight.scheduler.num_preemptions > 0
    assert _free_blocks(tight) == 29


def test_mixed_batch_stops_penalties_and_logprobs(tiny_model_dir):
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=25, repetition_penalty=1.3, frequency_penalty=0.2,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(3,), min_tokens=4),
              SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    expected, expected_lp, expected_reasons, _ = run(make_engine(tiny_model_dir), PROMPTS, params)
    got, got_lp, reasons, _ = run(make_engine(tiny_model_dir, speculate=3), PROMPTS, params)
    assert got == expected and reasons == expected_reasons
    for rid in ("r0", "r3"):  # the ones that ask (the others get them only beside these)
        assert len(got_lp[rid]) == len(got[rid])
        assert got_lp[rid] == pytest.approx(expected_lp[rid], abs=1e-4)
    assert [len(v) for v in got.values()] == [30, 25, len(expected["r2"]), 17, 1]


def test_seeded_sampling_gives_the_same_tokens(tiny_model_dir):
    params = [SamplingParams(temperature=0.3, top_k=20, top_p=0.9, seed=11 + i, max_tokens=30, ignore_eos=True)
              for i in range(len(PROMPTS))]
    expected, _, _, _ = run(make_engine(tiny_model_dir), PROMPTS, params)
    spec = make_engine(tiny_model_dir, speculate=4)
    got, _, _, _ = run(spec, PROMPTS, params)
    assert got == expected
    assert spec.scheduler.speculator.stats.num_accepted > 0


def test_abort_mid_speculation_frees_blocks_and_leaves_others(tiny_model_dir):
    spec = make_engine(tiny_model_dir, speculate=4, prefix_caching=False)
    free = _free_blocks(spec)
    undisturbed, _, _, _ = run(make_engine(tiny_model_dir), PROMPTS, GREEDY)
    got, _, _, _ = run(spec, PROMPTS, GREEDY, abort_after=("r3", 3))
    assert len(got["r3"]) < 40
    assert {k: v for k, v in got.items() if k != "r3"} == {k: v for k, v in undisturbed.items() if k != "r3"}
    assert _free_blocks(spec) == free
    assert not spec.scheduler.speculator._trackers


def test_adaptive_sizing_keeps_the_tokens_and_learns_the_row_cost(tiny_model_dir):
    expected, _, _, _ = run(make_engine(tiny_model_dir), PROMPTS, GREEDY)
    engine = make_engine(tiny_model_dir, speculate=4, adaptive=True)
    got, _, _, _ = run(engine, PROMPTS, GREEDY)
    assert got == expected
    speculator = engine.scheduler.speculator
    assert speculator.stats.num_verify_steps > 0
    assert speculator.cost._w > 0  # the engine reported its decode steps
