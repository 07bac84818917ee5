"""The autoscaler's Prometheus metrics (``strata:autoscaler_*``), served on ``--metrics-port``
(`services.common.metrics_http`): the replica counts, the signals it decides on, and every decision
(a counter by direction, and the last one's reason as an info-style gauge)."""

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.autoscaler.decision import Decision, ReplicaLoad
from services.autoscaler.provider import FleetState
from services.common.metrics_http import start_metrics_server


class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"strata:autoscaler_{name}", doc, labels, registry=self.registry)

        self.desired = gauge("desired_replicas", "Replicas the last decision asked for.")
        self.current = gauge("current_replicas", "Replicas asked of the provider: ready + starting.")
        self.ready = gauge("ready_replicas", "Replicas that report SERVING.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting, summed over the replicas' load reports.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Mean KV-cache usage of the reporting replicas, in [0, 1].")
        self.decisions = Counter("strata:autoscaler_decisions", "Decisions taken, by direction (up, down, hold).",
                                 ["direction"], registry=self.registry)
        self.last_decision = gauge("last_decision_info", "1 for the last decision's direction and reason.",
                                   ("direction", "reason"))
        self._last_labels: tuple[str, str] | None = None

    def start_http_server(self, host: str, port: int) -> None:
        start_metrics_server(host, port, self.registry)

    def observe(self, decision: Decision, fleet: FleetState, loads: list[ReplicaLoad]) -> None:
        self.desired.set(decision.desired)
        self.current.set(fleet.current)
        self.ready.set(fleet.ready)
        self.waiting.set(sum(load.num_waiting for load in loads))
        self.kv_usage.set(sum(load.kv_usage for load in loads) / len(loads) if loads else 0.0)
        self.decisions.labels(decision.direction).inc()
        labels = (decision.direction, decision.reason)
        if labels != self._last_labels:
            if self._last_labels is not None:
                self.last_decision.remove(*self._last_labels)
            self.last_decision.labels(*labels).set(1)
            self._last_labels = labels
