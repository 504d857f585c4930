"""Prefix caching with the fake runner: hash chains, hits, in-step sharing, eviction,
salts, share groups with caching off, prompt log-probabilities, failed steps."""
import pytest

from fake_runner import FakeRunner, assert_matches_reference, check_invariants, make_request, make_scheduler
from switchyard.core.kv import BlockPool
from switchyard.core.kv.block_hash import extend_block_hashes, hash_block, root_hash

PREFIX = list(range(100, 124))  # 24 tokens = 6 blocks of 4


def _first_step(runner, request_id):
    return next(s for o in runner.outputs for s in o.scheduled if s.request_id == request_id)


def test_hash_chain_depends_on_the_whole_prefix_and_the_salt():
    def hashes(tokens, salt=None):
        out = []
        extend_block_hashes(out, lambda a, b: tokens[a:b], len(tokens), 4, salt)
        return out

    a, b = hashes(list(range(12))), hashes([99] + list(range(1, 12)))
    assert len(a) == 3 and len({*a, *b}) == 6  # one differing token changes every later hash
    assert hashes(list(range(10))) == a[:2]  # partial blocks are not hashed
    assert hashes(list(range(12)), salt="lora-1") != a
    assert a[0] == hash_block(root_hash(None), range(4)) and len(a[0]) == 32  # sha256


def test_pool_caches_one_block_per_hash_and_evicts_lru():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert pool.cache_block(blocks[0], b"h0") and pool.cache_block(blocks[1], b"h1")
    assert not pool.cache_block(blocks[2], b"h0")  # a duplicate stays unhashed
    assert pool.cached_block(b"h0") == blocks[0] and pool.block_hashes[blocks[2]] is None
    pool.free(reversed(blocks))
    assert pool.cached_block(b"h1") == blocks[1] and pool.num_free_blocks == 4  # free but findable
    pool.incref([blocks[0]])  # a hit revives a free cached block
    assert not pool.is_free(blocks[0]) and pool.num_free_blocks == 3
    assert pool.allocate(2) == [4, blocks[2]]  # least recently freed first
    assert pool.allocate(1) == [blocks[1]] and pool.cached_block(b"h1") is None  # evicted, hash dropped
    with pytest.raises(ValueError):
        BlockPool(3).cache_block(1, b"x")  # only owned blocks are cached


def test_a_cached_prefix_is_not_computed_again_and_outputs_match():
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(scheduler)
    cold = make_request("cold", PREFIX + [1, 2, 3])
    scheduler.add_request(cold)
    runner.run_until_done()
    computed_cold = runner.num_computed_tokens
    warm = make_request("warm", PREFIX + [7, 8])
    scheduler.add_request(warm)
    runner.run_until_done()
    first = _first_step(runner, "warm")
    assert first.num_computed_tokens == 24 and first.token_ids == (7, 8)
    assert warm.num_cached_tokens == 24 and runner.num_computed_tokens - computed_cold == 2 + 7
    assert runner.outputs[-8].num_prefix_hit_tokens == 24 and runner.outputs[-8].num_prefix_queried_tokens == 26
    assert_matches_reference(runner, [cold, warm])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(scheduler)
    scheduler.add_request(first := make_request("first", PREFIX))
    runner.run_until_done()
    scheduler.add_request(again := make_request("again", PREFIX))
    runner.run_until_done()
    step = _first_step(runner, "again")
    # five full blocks, then the cached sixth block's first 3 slots copied into a fresh block: the
    # last token is computed there (its logits are needed), and nobody writes into the cached one
    assert step.num_computed_tokens == 23 and step.token_ids == tuple(PREFIX[23:]) and step.samples
    [output] = [o for o in runner.outputs if any(s.request_id == "again" for s in o.scheduled)][:1]
    [copy] = output.kv_copies
    assert copy.num_slots == 3 and copy.target == step.block_ids[5] and copy.target not in first_blocks(runner)
    assert again.output_token_ids == first.output_token_ids


def first_blocks(runner) -> set[int]:
    return set(_first_step(runner, "first").block_ids)


def test_a_prompt_that_shares_part_of_a_block_copies_those_slots():
    """A chat prompt sharing 22 tokens with a cached one (5 blocks of 4, then 2 tokens of the
    sixth) starts computing at token 22, not 20; the copied slots give the same context."""
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(scheduler)
    scheduler.add_request(cold := make_request("cold", PREFIX, max_tokens=3))
    runner.run_until_done()
    other = PREFIX[:22] + [901, 902, 903]
    scheduler.add_request(warm := make_request("warm", other, max_tokens=3))
    runner.run_until_done()
    step = _first_step(runner, "warm")
    assert step.num_computed_tokens == 22 and step.token_ids == (901, 902, 903)
    assert warm.num_cached_tokens == 22
    reference = make_scheduler(block_size=4, enable_prefix_caching=False)
    alone = FakeRunner(reference)
    reference.add_request(expected := make_request("warm", other, max_tokens=3))
    alone.run_until_done()
    assert warm.output_token_ids == expected.output_token_ids


def test_no_partial_hit_without_prefix_caching_or_from_a_block_of_this_step():
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", PREFIX, max_tokens=2))
    runner.run_until_done()
    scheduler.add_request(make_request("b", PREFIX[:22] + [5], max_tokens=2))
    runner.run_until_done()
    assert all(not o.kv_copies for o in runner.outputs)
    # a backend that cannot copy slots (Capabilities.partial_prefix_hits: TPU's static graphs)
    scheduler = make_scheduler(block_size=4, partial_hits=False)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", PREFIX, max_tokens=2))
    runner.run_until_done()
    scheduler.add_request(again := make_request("b", PREFIX[:22] + [5], max_tokens=2))
    runner.run_until_done()
    assert all(not o.kv_copies for o in runner.outputs) and again.num_cached_tokens == 20
    # two prompts admitted in one step: the second shares the first's full blocks, but never
    # copies from a block whose keys and values this very step writes (FakeRunner checks it)
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("c", PREFIX, max_tokens=2))
    scheduler.add_request(make_request("d", PREFIX[:22] + [5, 6], max_tokens=2))
    runner.step()
    assert not runner.outputs[0].kv_copies
    runner.run_until_done()


def test_requests_admitted_in_one_step_share_the_blocks_computed_in_it():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", PREFIX + [1]), make_request("b", PREFIX + [2, 3])
    scheduler.add_request(a)
    scheduler.add_request(b)
    runner = FakeRunner(scheduler)
    runner.step()
    step_a, step_b = (s for s in runner.outputs[0].scheduled)
    assert step_a.num_computed_tokens == 0 and step_b.num_computed_tokens == 24
    assert step_b.block_ids[:6] == step_a.block_ids[:6] and step_b.token_ids == (2, 3)
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.ref_counts[block_id] == 2 for block_id in step_a.block_ids[:6])
    runner.run_until_done()
    assert_matches_reference(runner, [a, b])


def test_prompt_logprobs_requests_skip_the_lookup_but_feed_the_cache():
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("warm", PREFIX + [5]))
    runner.run_until_done()
    scheduler.add_request(scored := make_request("scored", PREFIX + [6], prompt_logprobs=1))
    runner.step()
    assert _first_step(runner, "scored").num_computed_tokens == 0 and scored.num_cached_tokens == 0
    assert runner.outputs[-1].num_prefix_queried_tokens == 0


def test_cached_blocks_survive_until_blocks_run_out_then_lru_goes_first():
    scheduler = make_scheduler(num_blocks=9, block_size=4)  # 8 usable blocks
    runner = FakeRunner(scheduler)
    for name, prompt in (("old", [1] * 8 + [5]), ("new", [2] * 8 + [5])):
        scheduler.add_request(make_request(name, prompt, max_tokens=1))
        runner.run_until_done()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 8
    # 5 blocks: the 2 never used, then "old"'s 3 (freed tail first); "new"'s stay
    scheduler.add_request(make_request("filler", 19, max_tokens=1))
    runner.run_until_done()
    scheduler.add_request(make_request("new-again", [2] * 8 + [6], max_tokens=1))
    scheduler.add_request(make_request("old-again", [1] * 8 + [6], max_tokens=1))
    runner.run_until_done()
    assert _first_step(runner, "old-again").num_computed_tokens == 0
    assert _first_step(runner, "new-again").num_computed_tokens == 8


def test_different_salts_never_share():
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", PREFIX + [1], cache_salt="adapter-a"))
    scheduler.add_request(make_request("b", PREFIX + [1], cache_salt="adapter-b"))
    scheduler.add_request(make_request("c", PREFIX + [1], cache_salt="adapter-a"))
    runner.step()
    assert {s.request_id: s.num_computed_tokens for s in runner.outputs[0].scheduled} == {"a": 0, "b": 0, "c": 24}


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_a_share_group_shares_live_blocks_whether_or_not_caching_is_on(enable_prefix_caching):
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(scheduler)
    siblings = [make_request(f"n{i}", PREFIX + [9], share_group="g", max_tokens=5) for i in range(3)]
    stranger = make_request("stranger", PREFIX + [9], max_tokens=5)
    for request in (*siblings, stranger):
        scheduler.add_request(request)
    runner.step()
    computed = {s.request_id: s.num_computed_tokens for s in runner.outputs[0].scheduled}
    assert computed == {"n0": 0, "n1": 24, "n2": 24, "stranger": 24 if enable_prefix_caching else 0}
    runner.run_until_done()
    assert_matches_reference(runner, [*siblings, stranger])
    pool = scheduler.kv_cache_manager.block_pool
    # off: nothing is kept once the group ends; on: the prompt's blocks stay for later requests
    assert (pool.num_cached_blocks > 0) == enable_prefix_caching
    scheduler.add_request(later := make_request("later", PREFIX + [9], share_group="g"))
    runner.run_until_done()
    assert later.num_cached_tokens == (24 if enable_prefix_caching else 0)


def test_a_step_that_never_ran_forgets_the_hashes_it_registered():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", PREFIX + [1]))
    scheduler.schedule()  # the model step fails: no update()
    scheduler.abort_request("a")
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_cached_blocks == 6
    runner = FakeRunner(scheduler)
    scheduler.add_request(b := make_request("b", PREFIX + [1]))
    runner.run_until_done()
    assert b.num_cached_tokens == 0  # the blocks of the failed step were never written
    check_invariants(scheduler, runner)


def test_cached_blocks_never_make_a_fitting_prompt_wait_or_a_too_long_one_pass():
    from switchyard.core.params import ValidationError

    scheduler = make_scheduler(num_blocks=5, block_size=4)  # 16 tokens
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("fill", 14, max_tokens=1))
    runner.run_until_done()
    assert scheduler.kv_cache_manager.block_pool.num_cached_blocks == 3
    with pytest.raises(ValidationError, match="KV cache capacity of 16 tokens"):
        scheduler.add_request(make_request("too-long", 16))
    scheduler.add_request(whole := make_request("whole", 15, max_tokens=1))  # evicts every cached block
    runner.run_until_done()
    assert whole.num_cached_tokens == 0 and len(whole.output_token_ids) == 1


@pytest.mark.parametrize("mixes, caches", [(True, True), (False, False)])
def test_the_engine_scheduler_follows_the_narrowed_configuration(mixes, caches):
    from switchyard.core.backend import Capabilities
    from switchyard.core.capabilities import check_capabilities
    from switchyard.core.config import CacheConfig, EngineConfig
    from switchyard.core.scheduling.scheduler import Scheduler

    capabilities = Capabilities(dtypes=("float32",), block_sizes=(8, 16), mixed_prefill_decode=mixes,
                                prefix_caching=caches)
    config = check_capabilities("test", capabilities, EngineConfig(cache=CacheConfig(block_size=8)))
    scheduler = Scheduler.for_engine(config, 32)
    assert scheduler.config.mixed_prefill_decode is mixes and (scheduler.prefill_policy is None) is mixes
    assert scheduler.kv_cache_manager.enable_prefix_caching is caches
    assert scheduler.kv_cache_manager.block_size == 8 and scheduler.kv_cache_manager.block_pool.num_blocks == 32
    off = Scheduler.for_engine(EngineConfig(cache=CacheConfig(enable_prefix_caching=False)), 32)
    assert not off.kv_cache_manager.enable_prefix_caching
