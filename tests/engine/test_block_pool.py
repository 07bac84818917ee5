"""Exact tests of the block pool: ids, ref counts, LRU order, hash table, events."""

import pytest

from services.engine.block_pool import BlockPool
from services.engine.kv_events import AllCleared, BlocksRemoved, BlocksStored, RecordingKvEventSink


@pytest.fixture
def sink():
    return RecordingKvEventSink()


@pytest.fixture
def pool(sink):
    return BlockPool(8, sink)


def test_starts_all_free_in_id_order(pool):
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    assert pool.free_block_ids() == list(range(8))
    assert all(block.ref_cnt == 0 and block.block_hash is None for block in pool.blocks)


def test_allocation_takes_from_the_head_with_ref_count_one(pool):
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]
    assert pool.num_used_blocks == 3


def test_allocating_more_than_free_raises_and_changes_nothing(pool):
    pool.get_new_blocks(6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.free_block_ids() == [6, 7]


def test_freed_blocks_go_to_the_tail_in_the_given_order(pool):
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    assert pool.get_new_blocks(5)[-1].block_id == 3  # the request's last block is reused first


def test_shared_block_is_freed_only_at_ref_count_zero(pool):
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_block_ids()[-1] == 0


def test_cached_block_is_found_only_with_its_own_tokens(pool, sink):
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [111, 222], [(1, 2, 3, 4), (5, 6, 7, 8)], None)
    assert sink.take() == [BlocksStored(None, (111, 222))]
    assert pool.get_cached_block(222, [5, 6, 7, 8]) is blocks[1]
    assert pool.get_cached_block(222, [5, 6, 7, 9]) is None  # hash hit, tokens differ: a miss
    assert pool.get_cached_block(333, [5, 6, 7, 8]) is None


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue(pool):
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [111, 222], [(1, 2, 3, 4), (5, 6, 7, 8)], None)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    hit = pool.get_cached_block(111, (1, 2, 3, 4))
    pool.touch([hit])
    assert hit.block_id == 0 and hit.ref_cnt == 1
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1]
    assert hit.block_hash == 111  # still cached while used


def test_allocating_a_cached_free_block_evicts_it_in_lru_order(pool, sink):
    blocks = pool.get_new_blocks(8)
    pool.cache_full_blocks(blocks[:2], [111, 222], [(1, 2, 3, 4), (5, 6, 7, 8)], None)
    pool.free_blocks(reversed(blocks))  # free queue: 7 6 5 4 3 2 1 0
    sink.take()
    taken = pool.get_new_blocks(7)
    assert [b.block_id for b in taken] == [7, 6, 5, 4, 3, 2, 1]
    assert sink.take() == [BlocksRemoved((222,))]
    assert taken[-1].block_hash is None and taken[-1].token_ids == ()
    assert pool.get_cached_block(222, (5, 6, 7, 8)) is None
    assert pool.get_cached_block(111, (1, 2, 3, 4)) is blocks[0]


def test_duplicate_hash_keeps_the_first_block_and_events_stay_chains(pool, sink):
    first = pool.get_new_blocks(1)
    pool.cache_full_blocks(first, [222], [(5, 6, 7, 8)], 111)
    second = pool.get_new_blocks(3)
    pool.cache_full_blocks(second, [111, 222, 333], [(1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9)], None)
    assert sink.take() == [BlocksStored(111, (222,)), BlocksStored(None, (111,)), BlocksStored(222, (333,))]
    assert pool.get_cached_block(222, (5, 6, 7, 8)) is first[0]
    assert second[1].block_hash is None


def test_caching_an_already_cached_block_is_an_error(pool):
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [111], [(1, 2, 3, 4)], None)
    with pytest.raises(ValueError):
        pool.cache_full_blocks(blocks, [999], [(1, 2, 3, 4)], None)


def test_reset_prefix_cache_is_refused_while_blocks_are_used(pool, sink):
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [111, 222], [(1, 2, 3, 4), (5, 6, 7, 8)], None)
    sink.take()
    assert pool.reset_prefix_cache() is False
    assert sink.take() == []
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert sink.take() == [AllCleared()]
    assert pool.get_cached_block(111, (1, 2, 3, 4)) is None
    assert all(block.block_hash is None for block in pool.blocks)
    pool.get_new_blocks(8)
    assert sink.take() == []  # nothing left to evict
