"""Scheduler: token budget, chunking, max_num_seqs, preemption, FCFS, stops, aborts."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_runner import (FakeRunner, assert_matches_reference, check_invariants, context_sampler, make_request,
                         make_scheduler, scripted_sampler)
from switchyard.core.params import ValidationError
from switchyard.core.scheduling.request import FinishReason, RequestStatus


def _steps(output):
    return {s.request_id: s for s in output.scheduled}


def _assert_no_leak(scheduler):
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_token_budget_is_filled_exactly_and_never_exceeded():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 7))
    runner = FakeRunner(scheduler)
    runner.step()
    first = _steps(runner.outputs[0])
    assert {k: v.num_new_tokens for k, v in first.items()} == {"r0": 7, "r1": 3}
    assert first["r0"].samples and not first["r1"].samples
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    runner.run_until_done()
    assert all(o.num_batched_tokens <= 10 for o in runner.outputs)
    assert runner.outputs[1].num_batched_tokens == 10  # decode 1 + rest of r1 (4) + chunk of r2 (5)


def test_prompt_is_chunked_alongside_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=6, block_size=4)
    short, long = make_request("short", 2), make_request("long", 13)
    scheduler.add_request(short)
    scheduler.add_request(long)
    runner = FakeRunner(scheduler)
    runner.step()  # short: 2 (samples), long: 4
    runner.step()  # short: decode, long: 5
    runner.step()  # short: decode, long: 4 = the end of its prompt
    chunks = [_steps(o)["long"] for o in runner.outputs]
    assert [(c.num_computed_tokens, c.num_new_tokens, c.samples) for c in chunks] == [
        (0, 4, False), (4, 5, False), (9, 4, True)]
    assert sum((c.token_ids for c in chunks), ()) == tuple(long.prompt_token_ids)
    assert [len(c.block_ids) for c in chunks] == [1, 3, 4]
    assert chunks[0].block_ids == chunks[2].block_ids[:1]
    for output in runner.outputs[1:]:
        assert output.scheduled[0].request_id == "short"  # decodes first
        assert output.scheduled[0].num_new_tokens == 1 and output.scheduled[0].samples
    assert len(short.output_token_ids) == 3 and len(long.output_token_ids) == 1


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 3, max_tokens=2 + i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler)
    runner.step()
    assert set(_steps(runner.outputs[0])) == {"r0", "r1"} and scheduler.num_waiting == 1
    runner.step()  # r0 finishes after its second token
    assert [r.request_id for r in runner.finished] == ["r0"]
    runner.step()
    assert "r2" in _steps(runner.outputs[2])
    runner.run_until_done()
    assert max(len(o.scheduled) for o in runner.outputs) == 2
    _assert_no_leak(scheduler)


def _run_pressured(num_blocks):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=2, max_num_batched_tokens=16)
    requests = [make_request(f"r{i}", 3 + i, max_tokens=9) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler)
    runner.run_until_done()
    return runner, requests


def test_preemption_resumes_with_identical_outputs():
    relaxed, relaxed_requests = _run_pressured(num_blocks=64)
    pressured, requests = _run_pressured(num_blocks=10)
    assert not any(o.preempted_ids for o in relaxed.outputs)
    assert any(o.preempted_ids for o in pressured.outputs)
    assert sum(r.num_preemptions for r in requests) > 0
    for relaxed_request, request in zip(relaxed_requests, requests):
        assert request.output_token_ids == relaxed_request.output_token_ids
        assert request.finish_reason is FinishReason.LENGTH
    assert_matches_reference(pressured, requests)
    _assert_no_leak(pressured.scheduler)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_takes_the_last_admitted_and_recomputes_its_outputs(enable_prefix_caching):
    scheduler = make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=32,
                               enable_prefix_caching=enable_prefix_caching)
    a, b = make_request("a", 3, max_tokens=4), make_request("b", 3, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    runner = FakeRunner(scheduler)
    runner.step()  # a: 2 blocks, b: 2 blocks, pool empty
    runner.step()  # a and b decode position 3 in their second blocks
    output = scheduler.schedule()  # a needs a third block: b goes
    assert output.preempted_ids == ("b",) and list(_steps(output)) == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.block_ids == [] and b.num_computed_tokens == 0 and scheduler.waiting[0] is b
    first_block = runner.outputs[1].scheduled[1].block_ids[0]
    scheduler.update(output, runner.execute(output))
    runner.run_until_done()
    resumed = next(_steps(o)["b"] for o in runner.outputs[2:] if "b" in _steps(o))
    # b's tail block went to a (freed tail first, evicted first); its first block survives
    num_reused = 2 if enable_prefix_caching else 0
    assert resumed.num_computed_tokens == num_reused and resumed.num_new_tokens == 5 - num_reused
    assert resumed.token_ids == tuple(b.all_token_ids[num_reused:5])
    assert sum(o.num_prefix_hit_tokens for o in runner.outputs) == num_reused
    if enable_prefix_caching:
        assert resumed.block_ids[0] == first_block
    assert_matches_reference(runner, [a, b])
    _assert_no_leak(scheduler)


def test_a_request_that_is_the_last_preempts_itself_and_admits_nobody():
    # Budget 3: after the preemptions a 2-token chunk of b would fit the freed block.
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=3)
    a, b, c = make_request("a", 1), make_request("b", 1), make_request("c", 1)
    for request in (a, b, c):
        scheduler.add_request(request)
    runner = FakeRunner(scheduler)
    runner.step()
    runner.step()  # each holds one block holding two tokens: the pool is empty
    output = scheduler.schedule()  # a takes c's block, b finds none and preempts itself
    assert output.preempted_ids == ("c", "b") and list(_steps(output)) == ["a"]
    assert list(scheduler.waiting) == [b, c]  # earlier admission stays in front
    scheduler.update(output, runner.execute(output))
    runner.run_until_done()
    assert_matches_reference(runner, [a, b, c])


def test_fcfs_head_of_queue_is_never_overtaken():
    scheduler = make_scheduler(num_blocks=9, block_size=2, max_num_batched_tokens=64)
    scheduler.add_request(make_request("first", 6, max_tokens=6))  # holds 3..6 of 8 blocks
    scheduler.add_request(big := make_request("big", 12, max_tokens=2))  # needs 6 blocks
    runner = FakeRunner(scheduler)
    runner.step()
    for i in range(20):  # a stream of small requests that would fit
        scheduler.add_request(make_request(f"small{i}", 1, max_tokens=1))
        runner.step()
        if big.is_finished or big.status is RequestStatus.RUNNING:
            break
        assert [r.request_id for r in scheduler.running] in (["first"], []) and scheduler.waiting[0] is big
    assert big.status is not RequestStatus.WAITING
    first_step = {}
    for index, output in enumerate(runner.outputs):
        for request_id in _steps(output):
            first_step.setdefault(request_id, index)
    assert first_step["big"] <= min(v for k, v in first_step.items() if k.startswith("small"))
    runner.run_until_done()
    _assert_no_leak(scheduler)


def _finish_with(scripts, prompt_len=3, **kwargs):
    scheduler = make_scheduler()
    request = make_request("r", prompt_len, **kwargs)
    scheduler.add_request(request)
    runner = FakeRunner(scheduler, scripted_sampler({"r": scripts}, {"r": prompt_len}))
    runner.run_until_done()
    _assert_no_leak(scheduler)
    return request.output_token_ids, request.finish_reason


@pytest.mark.parametrize("script, kwargs, expected", [
    ([5, 2, 9], dict(eos=(2,)), ([5, 2], FinishReason.EOS)),
    ([2, 9], dict(eos=(2,), ignore_eos=True, max_tokens=3), ([2, 9, 7], FinishReason.LENGTH)),
    ([2, 2, 2, 2], dict(eos=(2,), min_tokens=3), ([2, 2, 2], FinishReason.EOS)),
    ([4, 3], dict(stop_token_ids=(3,)), ([4, 3], FinishReason.STOP_TOKEN)),
    ([3, 3], dict(stop_token_ids=(3,), min_tokens=2), ([3, 3], FinishReason.STOP_TOKEN)),
    ([3], dict(stop_token_ids=(3,), ignore_eos=True), ([3], FinishReason.STOP_TOKEN)),
    ([2], dict(eos=(2,), stop_token_ids=(2,)), ([2], FinishReason.EOS)),
    ([1, 1, 1], dict(max_tokens=3), ([1, 1, 1], FinishReason.LENGTH)),
    ([1, 2], dict(eos=(2,), max_tokens=2), ([1, 2], FinishReason.EOS)),  # EOS wins over length
    ([1, 1, 1], dict(max_tokens=None, max_model_len=5), ([1, 1], FinishReason.LENGTH)),
    ([1, 1, 1], dict(max_tokens=9, max_model_len=4), ([1], FinishReason.LENGTH)),
])
def test_stop_conditions(script, kwargs, expected):
    assert _finish_with(script, **kwargs) == expected


def test_kv_capacity_caps_a_request_without_max_tokens():
    scheduler = make_scheduler(num_blocks=3, block_size=4)  # 8 tokens
    scheduler.add_request(request := make_request("r", 5, max_tokens=None))
    FakeRunner(scheduler).run_until_done()
    assert request.num_tokens == 8 and request.finish_reason is FinishReason.LENGTH
    _assert_no_leak(scheduler)


@pytest.mark.parametrize("prompt_len, kwargs", [
    (8, {}),  # prompt + 1 > 8 tokens of KV capacity
    (5, dict(max_model_len=5)),
    (0, {}),
])
def test_requests_that_can_never_run_are_rejected_up_front(prompt_len, kwargs):
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    with pytest.raises(ValidationError):
        scheduler.add_request(make_request("r", prompt_len, **kwargs))
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("ok", 7, max_model_len=8))


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 3))
    with pytest.raises(ValidationError):
        scheduler.add_request(make_request("r", 3))


def test_finish_and_abort_waiting_and_running_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("running", 5), make_request("waiting", 5)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    runner = FakeRunner(scheduler)
    runner.step()
    assert running.block_ids and scheduler.get_request("waiting") is waiting
    assert scheduler.abort_request("waiting") is waiting
    assert scheduler.finish_request("running", FinishReason.STOP_STRING) is running
    assert (waiting.status, waiting.finish_reason) == (RequestStatus.FINISHED, FinishReason.ABORT)
    assert running.finish_reason is FinishReason.STOP_STRING and running.block_ids == []
    assert scheduler.abort_request("running") is None and scheduler.abort_request("nope") is None
    assert running.finish_reason is FinishReason.STOP_STRING  # idempotent
    assert scheduler.get_request("running") is None and scheduler.schedule().is_empty
    _assert_no_leak(scheduler)


def test_abort_of_a_preempted_request_and_between_schedule_and_update():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 1))
    runner = FakeRunner(scheduler)
    runner.step()
    runner.step()
    output = scheduler.schedule()
    assert scheduler.abort_request("c") is not None  # preempted, in waiting
    assert scheduler.abort_request("a") is not None  # scheduled this step
    assert scheduler.update(output, runner.execute(output)) == []
    runner.run_until_done()
    _assert_no_leak(scheduler)


def test_update_needs_a_token_for_every_sampling_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 2))
    output = scheduler.schedule()
    with pytest.raises(KeyError):
        scheduler.update(output, {})


def test_mixed_prefill_decode_false_still_schedules():
    scheduler = make_scheduler(mixed_prefill_decode=False, max_num_batched_tokens=4)
    requests = [make_request(f"r{i}", 6) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner(scheduler)
    runner.run_until_done()
    assert_matches_reference(runner, requests)


_add = st.tuples(st.just("add"), st.integers(1, 8), st.integers(1, 24), st.integers(0, 40))
_op = st.one_of(_add, _add, st.tuples(st.just("abort"), st.integers(0, 30)), st.tuples(st.just("step")))


def _small_vocab_sampler(request_id, context):
    return context_sampler(request_id, context) % 40  # so that EOS (one id of 40) is sampled


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(3, 10), block_size=st.integers(1, 4), budget=st.integers(1, 12),
       max_num_seqs=st.integers(1, 4), ops=st.lists(_op, min_size=4, max_size=50))
def test_random_interleavings_never_leak_and_always_finish(num_blocks, block_size, budget, max_num_seqs, ops):
    scheduler = make_scheduler(num_blocks, block_size, budget, max_num_seqs)
    runner = FakeRunner(scheduler, _small_vocab_sampler)
    added, aborted = [], set()
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, eos = op
            request = make_request(f"r{len(added)}", prompt_len, max_tokens=max_tokens, eos=(eos,))
            try:
                scheduler.add_request(request)
            except ValidationError:
                assert not scheduler.kv_cache_manager.can_ever_fit(prompt_len + 1)
                continue
            added.append(request)
        elif op[0] == "abort" and added:
            request = added[op[1] % len(added)]
            if scheduler.abort_request(request.request_id) is not None:
                aborted.add(request.request_id)
        elif op[0] == "step":
            runner.step()
        check_invariants(scheduler)
    runner.run_until_done(max_steps=2_000)
    _assert_no_leak(scheduler)
    assert all(r.is_finished for r in added)
    assert all(r.finish_reason is FinishReason.ABORT for r in added if r.request_id in aborted)
    assert_matches_reference(runner, [r for r in added if r.request_id not in aborted])
