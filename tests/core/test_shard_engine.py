"""The engine sharded over processes (core/engine/shard_worker.py): the same greedy tokens as one
shard, with prefix caching, preemption, abort, a grammar and n > 1 (failures, the default
model and two nodes: test_shard_runtime.py)."""
from __future__ import annotations

import os

import pytest
import torch

from switchyard.core import LLM, SamplingParams
from switchyard.core.grammar import GrammarSpec
from switchyard.core.scheduling.request import FinishReason, Request

pytestmark = pytest.mark.slow

# 4 prompts of 32 tokens at block size 4 need 4 x ~11 blocks; 30 blocks force preemptions
TINY = dict(backend="cpu", block_size=4, num_kv_blocks=30, max_num_batched_tokens=64)
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [1, 7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
           [1, 60, 61, 62, 63]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(autouse=True)
def _restore_pinning():
    """Rank 0 runs in this process and pins it (CpuBackend.init_device): undo it afterwards."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_tokenizer):
    from transformers import LlamaConfig

    from model_helpers import save_tiny

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=95, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    save_tiny(config, path)
    default_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    """(one shard, two shards) of the same model and cache."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    single = LLM(tiny_llama, **TINY)
    sharded = LLM(tiny_llama, tensor_parallel_size=2, **TINY)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    yield single, sharded
    sharded.shutdown()
    single.shutdown()


def _prefix_hits(llm: LLM, prompts, params) -> tuple[list, int]:
    hits, step = 0, llm.engine.step

    def counting_step():
        nonlocal hits
        outputs = step()
        hits += llm.engine.last_scheduler_output.num_prefix_hit_tokens
        return outputs

    llm.engine.step = counting_step
    try:
        return llm.generate(prompts, params), hits
    finally:
        del llm.engine.step


def test_two_shards_give_one_shards_greedy_tokens_with_preemption_and_prefix_hits(pair):
    single, sharded = pair
    expected = [r.token_ids for r in single.generate(PROMPTS, GREEDY)]
    preemptions = sharded.engine.scheduler.num_preemptions
    results, _ = _prefix_hits(sharded, PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected and all(len(t) == 32 for t in expected)
    assert sharded.engine.scheduler.num_preemptions > preemptions  # the tiny cache preempted
    sharded.generate(PROMPTS[2:3], GREEDY)  # its 3 full prompt blocks are cached ...
    again, hits = _prefix_hits(sharded, PROMPTS[2:3], GREEDY)  # ... and found
    assert again[0].token_ids == expected[2] and hits == 12


def test_sampling_with_n_and_a_grammar_match_one_shard(pair):
    single, sharded = pair
    seeded = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=12, ignore_eos=True)
    yes_no = SamplingParams(temperature=0.0, max_tokens=8, grammar=GrammarSpec.regex("(yes|no)( yes| no)*"))
    for params in (seeded, yes_no):
        want = single.generate(PROMPTS[:2], params)
        got = sharded.generate(PROMPTS[:2], params)
        assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in want]
    assert len(got[0].outputs[0].token_ids) > 0 and got[0].finish_reason in (FinishReason.GRAMMAR,
                                                                              FinishReason.LENGTH)


def _logprobs(engine, prompts, params) -> dict[str, list[tuple]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"lp-{i}", list(prompt), params))
    seen: dict[str, list[tuple]] = {f"lp-{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((out.new_token_ids, out.logprobs, out.top_logprobs))
    return seen


def test_log_probabilities_agree_within_1e_4(pair):
    single, sharded = pair
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    want, got = _logprobs(single.engine, PROMPTS, params), _logprobs(sharded.engine, PROMPTS, params)
    for rid, steps in want.items():
        assert [s[0] for s in got[rid]] == [s[0] for s in steps]
        for (_, logprobs, tops), (_, want_logprobs, want_tops) in zip(got[rid], steps):
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4)  # one per token of the step
            for top, want_top in zip(tops, want_tops, strict=True):
                assert [t for t, _ in top] == [t for t, _ in want_top]
                assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)


def test_abort_mid_generation_leaves_the_other_requests_alone(pair):
    single, sharded = pair
    expected = [r.token_ids for r in single.generate(PROMPTS[:3], GREEDY)]
    engine = sharded.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(Request(f"abort-{i}", list(prompt), GREEDY))
    outputs = {f"abort-{i}": [] for i in range(3)}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        if step == 3:
            engine.finish_request("abort-1", FinishReason.ABORT)
    assert len(outputs["abort-1"]) < 32
    assert [outputs["abort-0"], outputs["abort-2"]] == [list(expected[0]), list(expected[2])]
