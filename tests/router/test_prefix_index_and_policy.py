"""The router's prefix index (events in, overlaps out; gaps and restarts distrusted) and its cost
policy (a cached prefix pulls, load pushes away, equals rotate)."""

from services.common.pb import events_pb2
from services.router.policy import Candidate, choose, cost
from services.router.prefix_index import PrefixIndex


def batch(replica, seq, *events):
    return events_pb2.KvEventBatch(replica_id=replica, seq=seq, events=list(events), block_size=16)


def stored(*hashes, parent=None):
    event = events_pb2.KvBlocksStored(block_hashes=hashes)
    if parent is not None:
        event.parent_block_hash = parent
    return events_pb2.KvEvent(stored=event)


def removed(*hashes):
    return events_pb2.KvEvent(removed=events_pb2.KvBlocksRemoved(block_hashes=hashes))


CLEARED = events_pb2.KvEvent(cleared=events_pb2.KvCacheCleared())


def test_overlap_counts_leading_blocks_only():
    index = PrefixIndex()
    index.apply(batch("a", 7, stored(1, 2, 3), stored(4, parent=3)))  # the first batch may be any seq
    assert index.overlap("a", [1, 2, 3, 4, 5]) == 4
    assert index.overlap("a", [1, 9, 3]) == 1  # a chain stops at the first miss
    assert index.overlap("a", [9, 1]) == 0 and index.overlap("b", [1]) == 0
    index.apply(batch("a", 8, removed(2)))
    assert index.overlap("a", [1, 2, 3]) == 1
    index.apply(batch("a", 9, CLEARED, stored(5)))
    assert index.overlap("a", [1]) == 0 and index.overlap("a", [5]) == 1


def test_a_gap_or_a_restart_empties_the_replicas_index():
    index = PrefixIndex()
    index.apply(batch("a", 1, stored(1, 2)))
    index.apply(batch("b", 1, stored(1, 2)))
    index.apply(batch("a", 3, stored(3)))  # seq 2 was lost: maybe a removal of 1 or 2
    assert index.overlap("a", [1, 2]) == 0 and index.overlap("a", [3]) == 1 and index.num_blocks("a") == 1
    assert index.overlap("b", [1, 2]) == 2  # other replicas keep theirs
    index.apply(batch("b", 1, stored(9)))  # b restarted
    assert index.num_blocks("b") == 1 and index.overlap("b", [9]) == 1
    index.forget("b")
    assert index.overlap("b", [9]) == 0


def candidate(name, matched=0, used=0, in_flight_blocks=0, in_flight=0):
    return Candidate(name, matched, used, in_flight_blocks, in_flight)


def test_a_cached_prefix_wins_until_its_replica_is_busier_than_the_saving():
    cached, idle = candidate("cached", matched=6), candidate("idle")
    assert choose([idle, cached], prompt_blocks=8, turn=0).name == "cached"
    busy_cached = candidate("cached", matched=6, used=5)
    assert cost(busy_cached, 8) == 2 + 5 and cost(idle, 8) == 8
    assert choose([idle, busy_cached], prompt_blocks=8, turn=0).name == "cached"
    busier_cached = candidate("cached", matched=6, in_flight_blocks=7)  # the router's own count, not yet reported
    assert choose([idle, busier_cached], prompt_blocks=8, turn=0).name == "idle"


def test_equals_rotate_and_fewer_in_flight_breaks_ties():
    a, b = candidate("a"), candidate("b")
    assert [choose([a, b], 4, turn).name for turn in range(4)] == ["a", "b", "a", "b"]
    assert choose([candidate("a", in_flight=1), b], 4, 0).name == "b"
