"""Property-based: random interleavings of add (prompts sharing prefixes, n-sibling
groups), abort, finish, forced preemption and steps on a tiny pool, with prefix caching
on or off and mixed or separate prefill/decode steps. After every operation the block
accounting holds (fake_runner.check_invariants: ref counts equal holders, free + held
= all, cached hashes map back to their blocks, held cached blocks hold their tokens);
once adds stop everything finishes within a bound, with the outputs of a run without
a scheduler."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_runner import FakeRunner, check_invariants, context_sampler, make_request, make_scheduler, \
    reference_generate
from switchyard.core.params import ValidationError
from switchyard.core.scheduling.request import FinishReason

PREFIXES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]

_add = st.tuples(st.just("add"), st.integers(0, 1), st.integers(0, 12), st.integers(0, 4),  # prefix, cut, tail
                 st.integers(1, 12), st.integers(1, 3))  # max_tokens, n
_group = st.tuples(st.just("add"), st.integers(0, 1), st.integers(6, 12), st.integers(0, 2), st.integers(1, 6),
                   st.integers(2, 3))  # n sequences of one longer prompt
_op = st.one_of(_add, _group, st.tuples(st.just("abort"), st.integers(0, 30)),
                st.tuples(st.just("finish"), st.integers(0, 30)), st.tuples(st.just("preempt")),
                st.tuples(st.just("step")), st.tuples(st.just("step")))


def _sampler(request_id, context):
    return context_sampler(request_id, context) % 40  # EOS (one id of 40) is sampled now and then


def _add_group(scheduler, added, op):
    _, prefix, cut, tail, max_tokens, n = op
    prompt = PREFIXES[prefix][:cut] + [30 + len(added) % 7] * tail or [1]
    group = f"g{len(added)}"
    for _ in range(n):
        request = make_request(f"r{len(added)}", prompt, max_tokens=max_tokens, eos=(0,),
                               share_group=group if n > 1 else None)
        try:
            scheduler.add_request(request)
        except ValidationError:
            assert not scheduler.kv_cache_manager.can_ever_fit(len(prompt) + 1)
            return
        added.append(request)


def _force_preemption(scheduler):
    """Preempt the last-admitted running request between steps, as memory pressure would."""
    if scheduler.running:
        scheduler._preempt(scheduler.running.pop())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(3, 10), block_size=st.integers(1, 4), budget=st.integers(1, 12),
       max_num_seqs=st.integers(1, 4), caching=st.booleans(), mixed=st.booleans(),
       ops=st.lists(_op, min_size=4, max_size=40))
def test_random_interleavings_keep_blocks_consistent_and_finish(num_blocks, block_size, budget, max_num_seqs,
                                                                  caching, mixed, ops):
    scheduler = make_scheduler(num_blocks, block_size, budget, max_num_seqs, mixed_prefill_decode=mixed,
                               enable_prefix_caching=caching, waiting_served_ratio=0.5, max_waiting_tokens=3)
    runner = FakeRunner(scheduler, _sampler)
    added, cut_short = [], set()
    for op in ops:
        if op[0] == "add":
            _add_group(scheduler, added, op)
        elif op[0] in ("abort", "finish") and added:
            request = added[op[1] % len(added)]
            reason = FinishReason.ABORT if op[0] == "abort" else FinishReason.STOP_STRING
            if scheduler.finish_request(request.request_id, reason) is not None:
                cut_short.add(request.request_id)
        elif op[0] == "preempt":
            _force_preemption(scheduler)
        elif op[0] == "step":
            runner.step()
        check_invariants(scheduler, runner)
    work = sum(r.max_num_tokens for r in added if not r.is_finished)
    runner.run_until_done(max_steps=4 * work + 10)  # no request starves once adds stop
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks and all(r.is_finished for r in added)
    capacity = scheduler.kv_cache_manager.capacity_tokens
    for request in added:
        if request.request_id not in cut_short:
            assert (request.output_token_ids, request.finish_reason) == reference_generate(
                request, _sampler, capacity), request.request_id
