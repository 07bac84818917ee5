"""The autoscaler's loop between its inputs and its provider: load reports in, a decision out to
the provider, exported as metrics (the last reason included) and traced as a span when it scales.
The provider here is an in-memory fleet (the real ones are tested on processes, in
tests/e2e/test_autoscale.py, and against an HTTP API server, in test_kubernetes_provider.py)."""

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.autoscaler.decision import ScalingPolicy
from services.autoscaler.load import FleetLoad
from services.autoscaler.provider import FleetState
from services.autoscaler.service import Controller
from services.common.pb import engine_pb2


class InMemoryFleet:
    name = "in-memory"

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.calls: list[tuple[int, str]] = []

    def state(self) -> FleetState:
        return FleetState(current=self.replicas, ready=self.replicas)

    def scale_to(self, count: int, reason: str) -> None:
        self.calls.append((count, reason))
        self.replicas = count

    def close(self) -> None:
        pass


def report(replica_id: str, waiting: int, draining: bool = False) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(replica_id=replica_id, num_running=4, num_waiting=waiting, num_kv_blocks_used=10,
                                 num_kv_blocks_total=100, max_num_seqs=4, draining=draining)


def sample(controller: Controller, name: str, labels: dict | None = None) -> float | None:
    return controller.metrics.registry.get_sample_value(name, labels or {})


def test_a_queue_scales_the_fleet_and_the_decision_is_exported_and_traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    fleet = InMemoryFleet(replicas=1)
    load = FleetLoad(max_age_s=60)
    controller = Controller(ScalingPolicy(max_replicas=3, cooldown_s=0), fleet, load,
                            tracer=provider.get_tracer("test"))
    load.apply(report("engine-0", waiting=5))
    asyncio.run(controller.tick())
    assert fleet.calls == [(3, "waiting 5.0/replica > target 2 → 3 replicas")]
    assert sample(controller, "strata:autoscaler_desired_replicas") == 3
    assert sample(controller, "strata:autoscaler_current_replicas") == 1
    assert sample(controller, "strata:autoscaler_num_requests_waiting") == 5
    assert sample(controller, "strata:autoscaler_kv_cache_usage_perc") == 0.1
    assert sample(controller, "strata:autoscaler_decisions_total", {"direction": "up"}) == 1
    assert sample(controller, "strata:autoscaler_last_decision_info",
                  {"direction": "up", "reason": fleet.calls[0][1]}) == 1
    (span,) = exporter.get_finished_spans()
    assert span.name == "autoscaler.scale"
    assert span.attributes["strata.autoscaler.desired_replicas"] == 3
    assert span.attributes["strata.autoscaler.num_requests_waiting"] == 5

    asyncio.run(controller.tick())  # now 3, the same load: a hold, exported, not traced, not acted on
    assert len(fleet.calls) == 1 and len(exporter.get_finished_spans()) == 1
    assert sample(controller, "strata:autoscaler_decisions_total", {"direction": "hold"}) == 1
    assert sample(controller, "strata:autoscaler_last_decision_info",
                  {"direction": "up", "reason": fleet.calls[0][1]}) is None, "the old reason stays exported"


def test_a_draining_replica_stops_counting_at_once_and_stale_reports_expire():
    load = FleetLoad(max_age_s=5)
    load.apply(report("engine-0", waiting=1), now=100.0)
    load.apply(report("engine-1", waiting=2), now=103.0)
    assert sorted(r.replica_id for r in load.fresh(now=104.0)) == ["engine-0", "engine-1"]
    assert [r.replica_id for r in load.fresh(now=106.0)] == ["engine-1"]
    load.apply(report("engine-1", waiting=0, draining=True), now=106.5)
    assert load.fresh(now=106.5) == []
