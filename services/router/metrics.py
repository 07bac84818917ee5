"""The router's Prometheus metrics (``strata:router_*``, label ``replica`` = the replica's id or
address), served on ``--metrics-port`` (`services.common.metrics_http`)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics_http import start_metrics_server

_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter("strata:router_requests", "Requests sent to each replica (retries included).",
                              ["replica"], registry=self.registry)
        self.failovers = Counter("strata:router_failovers", "Requests moved to another replica after one "
                                 "failed before the first token.", ["replica"], registry=self.registry)
        self.migrations = Counter("strata:router_migrations", "Streams that went on on another replica after "
                                  "this one failed mid-way (--migration-limit).", ["replica"], registry=self.registry)
        self.healthy = Gauge("strata:router_replica_healthy", "1 while the replica is serving, else 0.",
                             ["replica"], registry=self.registry)
        self.in_flight = Gauge("strata:router_requests_in_flight", "This router's requests running on the replica.",
                               ["replica"], registry=self.registry)
        self.index_blocks = Gauge("strata:router_prefix_index_blocks", "Blocks the prefix index holds for the "
                                  "replica (from its KV events).", ["replica"], registry=self.registry)
        self.overlap = Histogram("strata:router_prefix_overlap_ratio", "Fraction of a prompt's full blocks the "
                                 "chosen replica already held, per routed request.",
                                 buckets=_FRACTION_BUCKETS, registry=self.registry)

        self.replicas = Gauge("strata:router_replicas", "Replicas the router knows (healthy or not).",
                              registry=self.registry)
        self.refused_reports = Counter("strata:router_refused_load_reports", "Load reports from unknown replicas "
                                       "that were not let join (unauthenticated NATS, no address, table full).",
                                       registry=self.registry)

    def keep_only(self, replicas: set[str]) -> None:
        """Drops the series of every replica not in ``replicas`` (the names the router knows now): a
        departed one, and the old name of a renamed one (a replica is named by its address until its
        Info gives its id, and by a new id when another engine takes its address), so that no
        stale label set lingers beside the live one."""
        for family in (self.routed, self.failovers, self.migrations, self.healthy, self.in_flight, self.index_blocks):
            exported = {sample.labels["replica"] for metric in family.collect() for sample in metric.samples}
            for replica in exported - replicas:
                family.remove(replica)

    def start_http_server(self, host: str, port: int) -> None:
        start_metrics_server(host, port, self.registry)
