"""BlockPool and KVCacheManager: reserved block 0, LRU free queue, ref counts, slots."""
import pytest

from switchyard.core.kv import RESERVED_BLOCK_ID, BlockPool, KVCacheManager, NoFreeBlocksError
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request


def test_block_zero_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_blocks == 5 and pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    block_ids = pool.allocate(4)
    assert sorted(block_ids) == [1, 2, 3, 4]
    assert RESERVED_BLOCK_ID not in block_ids and pool.num_free_blocks == 0
    pool.free(block_ids)
    assert RESERVED_BLOCK_ID not in pool.allocate(4)


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_free_queue_is_lru():
    pool = BlockPool(6)
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    pool.free([4])
    pool.free([2])
    pool.free([5])
    assert pool.allocate(2) == [4, 2]  # least recently freed first
    assert pool.allocate(1) == [5]


def test_initial_order_is_ascending():
    assert BlockPool(4).allocate(3) == [1, 2, 3]


def test_ref_counts_and_sharing():
    pool = BlockPool(4)
    [block_id] = pool.allocate(1)
    assert pool.ref_counts[block_id] == 1
    pool.incref([block_id])
    assert pool.ref_counts[block_id] == 2
    pool.free([block_id])
    assert pool.ref_counts[block_id] == 1 and not pool.is_free(block_id)
    assert pool.num_free_blocks == 2
    pool.free([block_id])
    assert pool.ref_counts[block_id] == 0 and pool.is_free(block_id) and pool.num_free_blocks == 3


def test_incref_of_a_free_block_revives_it():
    pool = BlockPool(4)
    block_ids = pool.allocate(3)
    pool.free(block_ids)
    pool.incref([2])
    assert not pool.is_free(2) and pool.ref_counts[2] == 1 and pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 3]


@pytest.mark.parametrize("block_id", [0, -1, 4, 99])
def test_bad_block_ids_are_rejected(block_id):
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.free([block_id])
    with pytest.raises(ValueError):
        pool.incref([block_id])


def test_double_free_is_a_bug():
    pool = BlockPool(4)
    block_ids = pool.allocate(2)
    pool.free(block_ids)
    with pytest.raises(ValueError, match="already free"):
        pool.free(block_ids[:1])
    with pytest.raises(ValueError):
        pool.free([3])  # never allocated
    assert pool.num_free_blocks == 3


def test_usage():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    pool.allocate(2)
    assert pool.usage == 0.5


def _request(num_prompt_tokens: int) -> Request:
    return Request("r", list(range(num_prompt_tokens)), SamplingParams())


def test_num_blocks_needed_counts_the_missing_blocks():
    manager = KVCacheManager(BlockPool(10), block_size=4)
    request = _request(10)
    assert manager.num_blocks_needed(request, 0) == 0
    assert manager.num_blocks_needed(request, 1) == 1
    assert manager.num_blocks_needed(request, 4) == 1
    assert manager.num_blocks_needed(request, 5) == 2
    assert manager.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    assert len(request.block_ids) == 2
    assert manager.num_blocks_needed(request, 3) == 0  # 8 tokens in 2 blocks
    assert manager.num_blocks_needed(request, 4) == 1


def test_allocate_slots_grows_block_ids():
    manager = KVCacheManager(BlockPool(10), block_size=4)
    request = _request(9)
    computed = 0
    for chunk in (3, 1, 4, 1):
        assert manager.allocate_slots(request, chunk)
        computed += chunk
        request.num_computed_tokens = computed
        assert len(request.block_ids) == -(-computed // 4)
    assert len(set(request.block_ids)) == 3 and manager.num_free_blocks == 6


def test_allocate_slots_is_all_or_nothing():
    manager = KVCacheManager(BlockPool(4), block_size=2)
    request = _request(10)
    assert manager.allocate_slots(request, 2)
    assert not manager.allocate_slots(request, 7)  # needs 3 more blocks, 2 free
    assert len(request.block_ids) == 1 and manager.num_free_blocks == 2
    assert manager.allocate_slots(request, 6)
    assert manager.num_free_blocks == 0


def test_free_returns_blocks_tail_first_and_clears():
    pool = BlockPool(5)
    manager = KVCacheManager(pool, block_size=2)
    request = _request(8)
    assert manager.allocate_slots(request, 6)
    block_ids = list(request.block_ids)
    manager.free(request)
    assert request.block_ids == [] and pool.num_free_blocks == 4
    manager.free(request)  # nothing held: a no-op
    assert pool.allocate(4) == [4, *reversed(block_ids)]


def test_can_ever_fit():
    manager = KVCacheManager(BlockPool(4), block_size=4)  # 3 usable blocks = 12 tokens
    assert manager.capacity_tokens == 12
    assert manager.can_ever_fit(12) and manager.can_ever_fit(1)
    assert not manager.can_ever_fit(13)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        KVCacheManager(BlockPool(4), block_size=0)
