"""Exact tests of the KV cache manager: prefix hits over chained hashes, allocation, caching as
tokens get computed, freeing and eviction, with the events each step emits. block_size 4."""

import pytest

from services.common.block_hash import hash_prompt_blocks
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_events import BlocksRemoved, BlocksStored, RecordingKvEventSink
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams

SEED = 1234


@pytest.fixture
def sink():
    return RecordingKvEventSink()


@pytest.fixture
def manager(sink):
    return KVCacheManager(num_blocks=8, block_size=4, hash_seed=SEED, event_sink=sink)


def make_request(request_id, token_ids, cache_salt=""):
    return Request(request_id, token_ids, SamplingParams(), cache_salt=cache_salt)


def admit(manager, request, num_new_tokens=None):
    """What the scheduler does on admission: look up hits, allocate the rest, mark hits computed."""
    blocks, num_computed = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_computed if num_new_tokens is None else num_new_tokens
    new_ids = manager.allocate_slots(request, num_new, blocks)
    assert new_ids is not None
    request.num_computed_tokens = num_computed
    return num_computed, new_ids


def compute(manager, request, num_tokens):
    request.num_computed_tokens += num_tokens
    manager.cache_blocks(request)


def hashes(token_ids, salt=""):
    return hash_prompt_blocks(token_ids, 4, SEED, salt)


def test_miss_then_full_blocks_cached_after_compute(manager, sink):
    prompt = list(range(10))
    request = make_request("a", prompt)
    assert admit(manager, request) == (0, [0, 1, 2])
    assert request.block_hashes == hashes(prompt)
    assert sink.take() == []  # nothing is cached before it is computed
    compute(manager, request, 10)
    h0, h1 = hashes(prompt)
    assert sink.take() == [BlocksStored(None, (h0, h1))]
    assert manager.block_pool.blocks[2].block_hash is None  # the partial block is never cached
    assert manager.block_ids(request) == [0, 1, 2]


def test_hit_shares_blocks_and_counts_tokens(manager):
    a = make_request("a", list(range(10)))
    admit(manager, a)
    compute(manager, a, 10)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert admit(manager, b) == (8, [3])
    assert manager.block_ids(b) == [0, 1, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    stats = manager.prefix_cache_stats
    assert (stats.num_queries, stats.num_hits) == (10 + 11, 8)


def test_never_the_whole_prompt_is_a_hit(manager):
    a = make_request("a", list(range(8)))
    admit(manager, a)
    compute(manager, a, 8)
    b = make_request("b", list(range(8)))
    assert admit(manager, b) == (4, [2])  # the last block is recomputed so there are logits
    assert manager.block_ids(b) == [0, 2]


def test_hash_hit_with_different_tokens_is_a_miss(manager):
    prompt = list(range(9))
    impostor = manager.block_pool.get_new_blocks(1)
    manager.block_pool.cache_full_blocks(impostor, hashes(prompt)[:1], [(9, 9, 9, 9)], None)
    request = make_request("a", prompt)
    assert manager.get_computed_blocks(request) == ([], 0)


def test_hits_stop_at_the_first_missing_block(manager):
    a = make_request("a", list(range(13)))
    admit(manager, a)
    compute(manager, a, 13)
    b = make_request("b", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12])
    blocks, num_computed = manager.get_computed_blocks(b)
    assert [block.block_id for block in blocks] == [0] and num_computed == 4


def test_cache_salt_separates_prefixes(manager):
    a = make_request("a", list(range(9)), cache_salt="tenant-1")
    admit(manager, a)
    compute(manager, a, 9)
    assert a.block_hashes == hashes(list(range(9)), "tenant-1")
    assert manager.get_computed_blocks(make_request("b", list(range(9)), cache_salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", list(range(9))))[1] == 0
    assert manager.get_computed_blocks(make_request("d", list(range(9)), cache_salt="tenant-1"))[1] == 8


def test_blocks_filled_by_decode_are_cached_with_their_parent(manager, sink):
    request = make_request("a", list(range(6)))
    admit(manager, request)
    compute(manager, request, 6)
    (h0,) = hashes(list(range(6)))
    assert sink.take() == [BlocksStored(None, (h0,))]
    request.append_output(100)  # sampled by the prefill step, computed by the next one
    assert manager.allocate_slots(request, 1) == []
    compute(manager, request, 1)
    assert sink.take() == []  # block 1 holds 3 computed tokens
    request.append_output(101)
    assert manager.allocate_slots(request, 1) == []
    compute(manager, request, 1)
    h1 = hashes(list(range(6)) + [100, 101])[1]
    assert request.block_hashes == [h0, h1]
    assert sink.take() == [BlocksStored(h0, (h1,))]
    request.append_output(102)
    assert manager.allocate_slots(request, 1) == [2]


def test_allocation_failure_changes_nothing(manager):
    a = make_request("a", list(range(20)))
    admit(manager, a)
    compute(manager, a, 20)
    b = make_request("b", list(range(100, 113)))
    assert manager.allocate_slots(b, 13) is None  # needs 4 blocks, 3 free
    assert manager.block_ids(b) == []
    assert manager.num_used_blocks == 5 and manager.block_pool.num_free_blocks == 3
    assert manager.allocate_slots(a, 13) is None  # 20 + 13 tokens need 9 blocks in all
    assert manager.block_ids(a) == [0, 1, 2, 3, 4]
    assert manager.allocate_slots(b, 12) == [5, 6, 7]


def test_hits_on_free_cached_blocks_cost_free_blocks(manager):
    a = make_request("a", list(range(16)))
    admit(manager, a)
    compute(manager, a, 16)
    manager.free(a)  # free queue: 4 5 6 7 3 2 1 0, blocks 0..3 cached
    filler = make_request("filler", list(range(100, 116)))
    assert manager.allocate_slots(filler, 16) == [4, 5, 6, 7]
    b = make_request("b", list(range(12)) + [77])
    blocks, num_computed = manager.get_computed_blocks(b)
    assert [block.block_id for block in blocks] == [0, 1, 2] and num_computed == 12
    assert manager.allocate_slots(b, 5, blocks) is None  # 3 hits + 2 new > 4 free
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [0, 0, 0]
    assert manager.allocate_slots(b, 1, blocks) == [3]  # evicts the cached block 3
    assert manager.block_ids(b) == [0, 1, 2, 3]
    assert manager.block_pool.num_free_blocks == 0


def test_free_is_tail_first_and_lru_evicts_the_oldest_cached_blocks(manager, sink):
    a = make_request("a", list(range(8)) + [0])
    admit(manager, a)
    compute(manager, a, 9)
    manager.free(a)
    b = make_request("b", list(range(100, 108)) + [0])
    admit(manager, b)
    compute(manager, b, 9)
    manager.free(b)
    ha = hashes(a.all_token_ids)
    sink.take()
    assert manager.block_pool.free_block_ids() == [6, 7, 2, 1, 0, 5, 4, 3]
    c = make_request("c", list(range(200, 220)))
    assert admit(manager, c) == (0, [6, 7, 2, 1, 0])
    assert sink.take() == [BlocksRemoved((ha[1], ha[0]))]  # a's last block went first
    assert manager.get_computed_blocks(make_request("d", b.all_token_ids))[1] == 8


def test_free_keeps_blocks_findable_and_leaves_everything_free(manager):
    a = make_request("a", list(range(9)))
    admit(manager, a)
    compute(manager, a, 9)
    manager.free(a)
    manager.free(a)  # a second free is a no-op
    assert manager.num_used_blocks == 0 and manager.usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 8


def test_usage_counts_used_blocks(manager):
    admit(manager, make_request("a", list(range(10))))
    assert manager.num_used_blocks == 3 and manager.usage == 3 / 8


def test_prefix_caching_off_hashes_nothing_and_hits_nothing(sink):
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, event_sink=sink)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    compute(manager, a, 9)
    manager.free(a)
    b = make_request("b", list(range(9)))
    assert admit(manager, b) == (0, [3, 4, 5])
    assert a.block_hashes == [] and b.block_hashes == []
    assert sink.events == []
    assert (manager.prefix_cache_stats.num_queries, manager.prefix_cache_stats.num_hits) == (0, 0)


def test_stats_are_not_counted_again_after_preemption(manager):
    a = make_request("a", list(range(9)))
    admit(manager, a)
    compute(manager, a, 9)
    manager.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    assert admit(manager, a) == (8, [3])
    assert (manager.prefix_cache_stats.num_queries, manager.prefix_cache_stats.num_hits) == (9, 0)


def test_reset_prefix_cache(manager, sink):
    a = make_request("a", list(range(9)))
    admit(manager, a)
    compute(manager, a, 9)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_decoding_takes_a_block_only_when_the_last_one_is_full(manager, sink):
    request = make_request("a", list(range(6)))
    admit(manager, request)
    compute(manager, request, 6)
    taken = []
    for token in range(100, 105):  # positions 6 .. 10: block 1 fills at 8, block 2 starts there
        request.append_output(token)
        taken.append(manager.allocate_slots(request, 1))
        compute(manager, request, 1)
    assert taken == [[], [], [2], [], []]
    assert manager.block_ids(request) == [0, 1, 2]
    assert manager.block_pool.num_free_blocks == 5
    table = manager.block_ids(request)
    table.append(7)  # a copy: the caller's list is its own
    assert manager.block_ids(request) == [0, 1, 2]
    manager.free(request)
    assert manager.block_ids(request) == []
