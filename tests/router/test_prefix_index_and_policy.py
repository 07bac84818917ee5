"""The router's prefix index (events in, overlaps out; gaps and restarts distrusted) and its policy
(most overlap while the load is balanced, least load otherwise, equals in turn)."""

from services.common.pb import events_pb2
from services.router.policy import Candidate, choose, is_balanced
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


def candidate(name, matched=0, load=0):
    return Candidate(name, matched, load)


def test_most_overlap_wins_while_the_fleet_is_balanced():
    cached, idle = candidate("cached", matched=6, load=3), candidate("idle", matched=1, load=0)
    assert is_balanced([cached, idle])
    assert choose([idle, cached], turn=0).name == "cached"
    # equal overlap (none, say): the least loaded, then in turn
    assert choose([candidate("a", load=2), candidate("b", load=1)], turn=0).name == "b"
    assert [choose([candidate("a"), candidate("b")], turn).name for turn in range(4)] == ["a", "b", "a", "b"]


def test_an_unbalanced_fleet_sends_requests_to_the_least_loaded():
    busy, idle = candidate("busy", matched=6, load=20), candidate("idle", load=2)
    assert not is_balanced([busy, idle])
    assert choose([busy, idle], turn=0).name == "idle"
    # both thresholds must be crossed: a large gap between large loads is still balanced
    assert is_balanced([candidate("a", load=100), candidate("b", load=90)])
    assert not is_balanced([candidate("a", load=12), candidate("b", load=3)])
    assert is_balanced([candidate("a", load=8), candidate("b", load=0)])
