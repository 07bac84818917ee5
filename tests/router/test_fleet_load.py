"""The router's Load answer speaks for the fleet: gauges over the replicas that answer now, counters
over every replica that has answered, so that they never go backwards when one stops answering."""

from services.common.pb import engine_pb2
from services.router.placement import Placement
from services.router.prefix_index import PrefixIndex
from services.router.replicas import Replica, ReplicaSet
from services.router.server import RouterServicer


def report(replica_id: str, running: int, queries: int, hits: int, preemptions: int) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(replica_id=replica_id, num_running=running, num_kv_blocks_total=100,
                                 max_num_seqs=4, prefix_cache_queries=queries, prefix_cache_hits=hits,
                                 num_preemptions=preemptions)


def test_counters_keep_a_silent_replicas_count_and_gauges_do_not():
    router = RouterServicer(Placement(ReplicaSet([]), PrefixIndex(), hash_seed=0), router_id="router-0")
    both = router._fleet_load([report("e0", 2, 100, 40, 1), report("e1", 3, 50, 10, 2)])
    assert (both.replica_id, both.address, both.draining) == ("router-0", "", False)
    assert (both.num_running, both.num_kv_blocks_total, both.max_num_seqs) == (5, 200, 8)
    assert (both.prefix_cache_queries, both.prefix_cache_hits, both.num_preemptions) == (150, 50, 3)
    one = router._fleet_load([report("e0", 1, 120, 45, 1)])  # e1 paused: its work still happened
    assert (one.num_running, one.num_kv_blocks_total, one.max_num_seqs) == (1, 100, 4)
    assert (one.prefix_cache_queries, one.prefix_cache_hits, one.num_preemptions) == (170, 55, 3)
    back = router._fleet_load([report("e0", 0, 120, 45, 1), report("e1", 0, 60, 12, 2)])
    assert (back.prefix_cache_queries, back.prefix_cache_hits, back.num_preemptions) == (180, 57, 3)


def test_a_forgotten_replica_keeps_its_counts_but_not_its_entry():
    replicas = ReplicaSet([])
    router = RouterServicer(Placement(replicas, PrefixIndex(), hash_seed=0), router_id="router-0")
    for k in range(50):  # replicas that came and went, as under an autoscaler
        router._fleet_load([report(f"scaled-{k}", 1, 10, 4, 1)])
        replicas.on_forgotten(Replica(f"127.0.0.1:{9000 + k}", None, None, None, replica_id=f"scaled-{k}"))
    total = router._fleet_load([report("e0", 2, 100, 40, 1)])
    assert (total.num_running, total.prefix_cache_queries, total.prefix_cache_hits, total.num_preemptions) == \
        (2, 600, 240, 51)
    assert list(router._counted) == ["e0"]
