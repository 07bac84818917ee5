"""The router's per-replica series follow the replicas it knows: a replica's series under its address
(before its Info named it) or under an id it no longer has, and a departed replica's, are dropped."""

from services.router.metrics import RouterMetrics


def series(metrics: RouterMetrics) -> set[tuple[str, str]]:
    return {(sample.name, sample.labels["replica"]) for family in metrics.registry.collect()
            for sample in family.samples if "replica" in sample.labels and not sample.name.endswith("_created")}


def test_only_the_known_replicas_keep_their_series():
    metrics = RouterMetrics()
    metrics.healthy.labels("127.0.0.1:5001").set(0)  # checked before its Info answered
    for name in ("engine-0", "engine-1", "engine-9"):
        metrics.healthy.labels(name).set(1)
        metrics.routed.labels(name).inc()
        metrics.in_flight.labels(name).set(0)
    metrics.failovers.labels("engine-9").inc()
    metrics.keep_only({"engine-0", "engine-1"})  # engine-0 was 127.0.0.1:5001; engine-9 left
    assert {replica for _, replica in series(metrics)} == {"engine-0", "engine-1"}
    assert ("strata:router_requests_total", "engine-1") in series(metrics)
    metrics.keep_only(set())
    assert series(metrics) == set()
