"""Chunked prefill with decodes first, fairness under memory pressure, and TGI's
prefill/decode policy for backends that cannot mix them (mixed_prefill_decode=False)."""
import pytest

from fake_runner import FakeRunner, make_request, make_scheduler, reference_generate
from switchyard.core.scheduling.prefill_policy import PrefillPolicy


def _ids(output):
    return [s.request_id for s in output.scheduled]


def _is_prefill_step(output):
    return any(s.num_new_tokens > 1 or not s.samples for s in output.scheduled)


def _assert_matches_reference(runner, requests):
    capacity = runner.scheduler.kv_cache_manager.capacity_tokens
    for request in requests:
        assert (request.output_token_ids, request.finish_reason) == reference_generate(
            request, runner.sampler, capacity), request.request_id


def test_running_streams_never_stall_behind_a_long_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=8, block_size=4)
    streams = [make_request(f"s{i}", 2, max_tokens=30) for i in range(3)]
    for request in streams:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler)
    runner.step()
    scheduler.add_request(long := make_request("long", 60, max_tokens=2))
    while not long.output_token_ids:
        runner.step()
        step = runner.outputs[-1]
        assert _ids(step)[:3] == ["s0", "s1", "s2"]  # every stream decodes in every step
        assert step.num_batched_tokens == 8  # and the prompt takes the rest of the budget
    runner.run_until_done()
    _assert_matches_reference(runner, [*streams, long])


def test_a_prompt_chunk_shrinks_to_the_room_left():
    scheduler = make_scheduler(num_blocks=7, block_size=2, max_num_batched_tokens=7)  # 6 usable blocks
    scheduler.add_request(a := make_request("a", 3, max_tokens=3))
    scheduler.add_request(b := make_request("b", 9, max_tokens=1))
    runner = FakeRunner(scheduler)
    runner.step()  # a: 3 tokens (2 blocks), b: 4 of its 9 (2 blocks); 2 blocks left
    runner.step()  # a decodes in its second block; b wants 5 tokens (3 blocks), 4 fit
    assert [(s.request_id, s.num_new_tokens) for s in runner.outputs[1].scheduled] == [("a", 1), ("b", 4)]
    runner.run_until_done()
    _assert_matches_reference(runner, [a, b])


@pytest.mark.parametrize("mixed", [True, False])
def test_every_step_respects_the_budget_the_batch_size_and_the_kv_capacity(mixed):
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=7, max_num_seqs=3,
                               mixed_prefill_decode=mixed)
    requests = [make_request(f"r{i}", 3 + 5 * (i % 4), max_tokens=6 + i % 3) for i in range(10)]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler)  # asserts the budget and the batch size after every step
    pool = scheduler.kv_cache_manager.block_pool
    while scheduler.has_unfinished_requests():
        runner.step()
        assert scheduler.num_running <= 3
        held = sum(len(r.block_ids) for r in scheduler.running)  # no prefixes shared here
        assert held == pool.num_usable_blocks - pool.num_free_blocks <= 11
    _assert_matches_reference(runner, requests)


def test_an_earlier_prefill_is_not_starved_by_later_decodes_under_memory_pressure():
    scheduler = make_scheduler(num_blocks=7, block_size=2, max_num_batched_tokens=4)
    scheduler.add_request(early := make_request("early", 9, max_tokens=2))
    runner = FakeRunner(scheduler)
    runner.step()
    for i in range(12):  # a stream of later short requests
        scheduler.add_request(make_request(f"late{i}", 1, max_tokens=4))
    for _ in range(40):
        runner.step()
        if early.is_finished:
            break
    assert early.is_finished and early.num_preemptions == 0
    runner.run_until_done()


# ---- backends that cannot mix prefill and decode ---------------------------------------

def test_prefill_policy_follows_tgi():
    policy = PrefillPolicy(waiting_served_ratio=1.2, max_waiting_tokens=4)
    assert not policy.takes_prefill(num_decodable=3, num_prefill_candidates=0)
    assert policy.takes_prefill(num_decodable=0, num_prefill_candidates=1)  # the batch is empty
    assert not policy.takes_prefill(10, 11) and policy.takes_prefill(10, 12)  # floor(10 x 1.2) = 12
    policy.record(was_prefill=True)
    assert not policy.takes_prefill(10, 50)  # the batch decodes after every prefill
    policy.record(False)
    policy.record(False)
    assert not policy.takes_prefill(10, 1)
    policy.record(False)  # waiting_tokens = 4
    assert policy.takes_prefill(10, 1)
    assert PrefillPolicy(0.3, 20).takes_prefill(3, 1)  # floor(3 x 0.3) = 0: TGI adds to small batches at once
    with pytest.raises(ValueError):
        PrefillPolicy(0.3, 0)


def _run_unmixed(ratio, max_waiting_tokens, num_late=1):
    scheduler = make_scheduler(max_num_batched_tokens=64, mixed_prefill_decode=False,
                               waiting_served_ratio=ratio, max_waiting_tokens=max_waiting_tokens)
    early = [make_request(f"e{i}", 5, max_tokens=40) for i in range(4)]
    for request in early:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler)  # asserts that no step mixes prefill and decode
    runner.step()
    runner.step()
    late = [make_request(f"l{i}", 5, max_tokens=3) for i in range(num_late)]
    for request in late:
        scheduler.add_request(request)
    waited = 0
    while not all(r.output_token_ids for r in late):
        runner.step()
        waited += 1
    runner.run_until_done()
    _assert_matches_reference(runner, early + late)
    return runner, waited


def test_unmixed_steps_force_a_prefill_after_max_waiting_tokens():
    runner, waited = _run_unmixed(ratio=10.0, max_waiting_tokens=6)
    assert waited == 5  # 4 decode steps (waiting_tokens 2..5 after the first two steps), then the prefill
    kinds = [_is_prefill_step(o) for o in runner.outputs]
    assert kinds[:7] == [True, False, False, False, False, False, True]


def test_unmixed_steps_prefill_once_enough_requests_wait():
    _, waited_one = _run_unmixed(ratio=0.5, max_waiting_tokens=100, num_late=1)
    _, waited_two = _run_unmixed(ratio=0.5, max_waiting_tokens=100, num_late=2)
    assert waited_one > 30  # 1 < floor(4 x 0.5): waits until the batch shrinks
    assert waited_two == 1  # 2 >= floor(4 x 0.5): prefilled at once


def test_unmixed_long_prompt_chunks_alternate_with_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8, mixed_prefill_decode=False, waiting_served_ratio=0.0)
    scheduler.add_request(stream := make_request("stream", 3, max_tokens=20))
    runner = FakeRunner(scheduler)
    runner.step()
    scheduler.add_request(long := make_request("long", 30, max_tokens=2))
    while not long.output_token_ids:
        runner.step()
    kinds = [_is_prefill_step(o) for o in runner.outputs[1:]]
    assert kinds == [False, True] * 4  # 8 + 8 + 8 + 6 prompt tokens, a decode after each chunk
    runner.run_until_done()
    _assert_matches_reference(runner, [stream, long])
