"""`BatchHistogram` (the engine's inter-token latency series): the same exposition as prometheus_client's
own histogram fed the same values one by one, whatever the batches, but the ``_created`` sample."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.engine.batch_histogram import BatchHistogram

BUCKETS = (0.01, 0.025, 0.05, 0.1, 1.0)
VALUES = [0.001, 0.01, 0.02, 0.0250001, 0.3, 100.0, 0.05, 0.0]  # on a bound, between, past the last


def test_it_exposes_what_prometheus_clients_histogram_does():
    expected = CollectorRegistry()
    one_by_one = Histogram("strata:t", "Doc.", ["model_name", "replica"], buckets=BUCKETS,
                           registry=expected).labels("m", "engine-0")
    for value in VALUES:
        one_by_one.observe(value)
    registry = CollectorRegistry()
    batched = BatchHistogram("strata:t", "Doc.", {"model_name": "m", "replica": "engine-0"}, BUCKETS, registry)
    batched.observe_all(VALUES[:3])
    batched.observe_all([])
    batched.observe_all(iter(VALUES[3:]))
    assert generate_latest(registry).decode().splitlines() == [
        line for line in generate_latest(expected).decode().splitlines() if "_created" not in line]
    assert registry.get_sample_value("strata:t_count", {"model_name": "m", "replica": "engine-0"}) == len(VALUES)
