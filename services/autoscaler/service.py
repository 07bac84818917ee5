"""The autoscaler's loop: every ``interval_s``, the fleet's load (NATS load reports) and the
provider's state go into ``Autoscaler.decide``; a decision to scale is carried out by the provider.

Every decision is exported (`metrics.py`); one that scales, or a hold whose reason changed, is
logged with its reason; one that scales is also traced as a span (``autoscaler.scale``, with the
signals it saw), so a replica appearing in Jaeger can be traced back to the queue that asked for it.
Holds are not traced: one every few seconds would bury the traces that matter.
"""

import asyncio
import logging
import time

from opentelemetry import trace

from services.autoscaler.decision import Autoscaler, ScalingPolicy
from services.autoscaler.load import FleetLoad
from services.autoscaler.metrics import AutoscalerMetrics
from services.autoscaler.provider import ReplicaProvider
from services.common.grpc_server import GrpcServer
from services.common.tls import TlsFiles

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("strata.autoscaler")


class Controller:
    def __init__(self, policy: ScalingPolicy, provider: ReplicaProvider, load: FleetLoad,
                 metrics: AutoscalerMetrics | None = None, tracer: trace.Tracer | None = None) -> None:
        self.autoscaler = Autoscaler(policy)
        self.tracer = tracer or _tracer
        self.provider = provider
        self.load = load
        self.metrics = metrics or AutoscalerMetrics()
        self._last_reason = ""

    async def tick(self) -> None:
        fleet = await asyncio.to_thread(self.provider.state)
        loads = self.load.fresh()
        decision = self.autoscaler.decide(time.monotonic(), loads, fleet)
        self.metrics.observe(decision, fleet, loads)
        if decision.direction == "hold":
            if decision.reason != self._last_reason:
                log.info("hold at %d (ready %d): %s", fleet.current, fleet.ready, decision.reason)
            self._last_reason = decision.reason
            return
        self._last_reason = decision.reason
        log.info("scale %s: %d -> %d replicas: %s", decision.direction, decision.current, decision.desired,
                 decision.reason)
        with self.tracer.start_as_current_span("autoscaler.scale", attributes={
                "strata.autoscaler.direction": decision.direction, "strata.autoscaler.reason": decision.reason,
                "strata.autoscaler.current_replicas": decision.current,
                "strata.autoscaler.desired_replicas": decision.desired,
                "strata.autoscaler.ready_replicas": fleet.ready, "strata.autoscaler.provider": self.provider.name,
                "strata.autoscaler.num_requests_waiting": sum(load.num_waiting for load in loads),
                "strata.autoscaler.reporting_replicas": len(loads)}):
            await asyncio.to_thread(self.provider.scale_to, decision.desired, decision.reason)

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a provider error (API down, say): keep deciding, the next tick retries
                log.exception("autoscaler tick failed")
            await asyncio.sleep(interval_s)


async def serve(controller: Controller, nats_url: str, host: str, port: int, interval_s: float,
                tls: TlsFiles | None = None) -> None:
    """Runs the loop and serves grpc.health.v1 (SERVING while it runs) until SIGTERM/SIGINT; then
    the provider is closed (a local provider drains its replicas)."""
    server = GrpcServer([])
    bound = server.add_port(f"{host}:{port}", tls)
    await server.start()
    connection = await controller.load.follow(nats_url)
    await server.set_serving()
    log.info("autoscaler (%s provider) on %s:%d", controller.provider.name, host, bound)
    loop_task = asyncio.create_task(controller.run(interval_s))
    try:
        await server.wait_for_termination()
    finally:
        loop_task.cancel()
        await connection.close()
        await asyncio.to_thread(controller.provider.close)
