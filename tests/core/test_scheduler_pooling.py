"""Pooling (embedding) requests in the scheduler: prompts only, chunked like any prompt, finished
(POOLED, blocks freed) in the step that computes their last token, batched beside generation, never
hashing a block; with chunk_prompts off (encoders) a prompt runs whole in one step or waits."""
import pytest

from fake_runner import FakeRunner, make_request, make_scheduler
from switchyard.core.params import ValidationError
from switchyard.core.pooling.params import PoolingParams
from switchyard.core.scheduling.request import FinishReason, RequestStatus, pooling_request


def _pooling(request_id: str, length: int, max_model_len: int = 1 << 30):
    request = pooling_request(request_id, [(7 * i + len(request_id)) % 1000 for i in range(length)], PoolingParams())
    request.max_model_len = max_model_len
    return request


def _steps(output):
    return {s.request_id: s for s in output.scheduled}


def _update(scheduler, output):
    """update() as the engine calls it: sampled tokens for the requests that sample."""
    return scheduler.update(output, {s.request_id: 5 for s in output.scheduled if s.samples})


def test_a_pooling_request_is_chunked_and_finishes_in_the_step_of_its_last_token():
    scheduler = make_scheduler(max_num_batched_tokens=5, block_size=4)
    request = _pooling("p", 12)
    scheduler.add_request(request)
    chunks = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        chunks.append(_steps(output)["p"])
        finished = _update(scheduler, output)
    assert [(c.num_computed_tokens, c.num_new_tokens) for c in chunks] == [(0, 5), (5, 5), (10, 2)]
    assert all(c.pools and not c.samples and c.num_logits == 0 for c in chunks)
    assert finished == [request] and request.finish_reason is FinishReason.POOLED
    assert request.status is RequestStatus.FINISHED and request.output_token_ids == [] and not request.block_ids
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_pooling_requests_share_steps_with_generation_and_only_generation_samples():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("g", 6, max_tokens=3))
    scheduler.add_request(_pooling("p1", 9))
    output = scheduler.schedule()
    steps = _steps(output)
    assert steps["g"].samples and not steps["g"].pools and steps["p1"].pools and not steps["p1"].samples
    assert [r.request_id for r in _update(scheduler, output)] == ["p1"]
    scheduler.add_request(_pooling("p2", 4))
    output = scheduler.schedule()  # g decodes beside p2's prompt
    assert {s.request_id: s.num_new_tokens for s in output.scheduled} == {"g": 1, "p2": 4}
    assert [r.request_id for r in _update(scheduler, output)] == ["p2"]


def test_pooling_requests_hash_no_block_and_find_none():
    """Even under one share group and with prefix caching on: a pooling request reads every
    position's hidden state, which a cached block would skip."""
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=True)
    first, second = _pooling("a", 9), _pooling("a2", 9)
    second.prompt_token_ids = list(first.prompt_token_ids)
    first.share_group = second.share_group = "group"
    for request in (first, second):
        scheduler.add_request(request)
    manager = scheduler.kv_cache_manager
    output = scheduler.schedule()
    assert {s.request_id: s.num_computed_tokens for s in output.scheduled} == {"a": 0, "a2": 0}
    assert not first.block_hashes and not second.block_hashes and set(first.block_ids).isdisjoint(second.block_ids)
    assert not manager.looks_up(first) and not manager.hashes_blocks(first)


def test_a_prompt_as_long_as_the_context_is_accepted_for_pooling_only():
    scheduler = make_scheduler()
    scheduler.add_request(_pooling("p", 16, max_model_len=16))  # generates nothing: the context suffices
    with pytest.raises(ValidationError, match="with one generated token"):
        scheduler.add_request(make_request("g", 16, max_model_len=16))
    with pytest.raises(ValidationError, match="exceeds the context length of 16 tokens"):
        scheduler.add_request(_pooling("q", 17, max_model_len=16))


def test_without_chunked_prompts_a_prompt_runs_whole_or_waits_for_room():
    scheduler = make_scheduler(max_num_batched_tokens=10, block_size=4, chunk_prompts=False)
    for request_id, length in (("a", 6), ("b", 6), ("c", 3)):
        scheduler.add_request(_pooling(request_id, length))
    runner_steps = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        runner_steps.append({s.request_id: (s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled})
        _update(scheduler, output)
    # b does not fit beside a (4 tokens left) and nobody overtakes it (FCFS)
    assert runner_steps == [{"a": (0, 6)}, {"b": (0, 6), "c": (0, 3)}]
    with pytest.raises(ValidationError, match="computes a prompt in one step, whose token budget is 10"):
        scheduler.add_request(_pooling("d", 11))


def test_an_aborted_pooling_request_frees_its_blocks_mid_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=4, block_size=4)
    scheduler.add_request(_pooling("p", 12))
    _update(scheduler, scheduler.schedule())
    assert scheduler.finish_request("p", FinishReason.ABORT).finish_reason is FinishReason.ABORT
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1 and not scheduler.has_unfinished_requests()


def test_the_fake_runner_still_runs_generation_beside_pooling():
    """Generation outputs are unchanged by pooling requests sharing their steps (FakeRunner reads
    every context back through the block tables)."""
    alone = make_scheduler(max_num_batched_tokens=8)
    alone.add_request(make_request("g", 10, max_tokens=5))
    expected = FakeRunner(alone)
    expected.run_until_done()
    mixed = make_scheduler(max_num_batched_tokens=8)
    mixed.add_request(make_request("g", 10, max_tokens=5))
    for i in range(3):
        mixed.add_request(_pooling(f"p{i}", 5))
    runner = FakeRunner(mixed)
    runner.run_until_done()
    outputs = {r.request_id: r.output_token_ids for r in runner.finished}
    assert outputs["g"] == expected.finished[0].output_token_ids
    assert all(outputs[f"p{i}"] == [] for i in range(3))
