"""The engine replicas behind the router: their channels, health and load.

A replica is healthy while its gRPC health check says SERVING; it is checked every
``check_interval_s``, and also marked down at once when a call to it fails as unavailable. Its load
comes from its NATS load reports, or, without NATS or when reports stop, from polling ``Load``.
Replicas are given by address at start, and a load report from an address not yet known adds one
(engines can join by publishing: the autoscaler's new replicas do), but only when the router's
NATS connection is authenticated (`services.common.nats_auth`: then only holders of the token can
publish) and only up to ``max_joined`` of them; a report that may not join is dropped and logged.
A replica whose report says it is draining (scale-down, SIGTERM) is taken out of routing at once,
without waiting for the next health check; one that joined by publishing is forgotten once it has been down ``forget_after_s``
(a drained replica does not come back; a restarted one joins again with its next report).
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import engine_pb2, engine_pb2_grpc
from services.common.shared_generate import SharedGenerate
from services.common.tls import TlsFiles, aio_channel

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
REPORT_FRESH_S = 3.0  # a load report older than this is stale: poll instead


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    replica_id: str = ""  # from its Info, once reachable
    info: engine_pb2.EngineInfoResponse | None = None
    healthy: bool = False
    num_waiting: int = 0  # from its load reports (other routers' traffic shows here)
    load_at: float = 0.0  # monotonic time of the last load figure
    in_flight: int = 0  # this router's requests running there
    static: bool = False  # given at start (kept while down) rather than joined by a load report
    down_since: float | None = None  # monotonic time it stopped being healthy (or was added)
    unresponsive: asyncio.Event = field(default_factory=asyncio.Event)  # its health check failed; renewed when healthy
    shared: SharedGenerate | None = None  # the router's GenerateMany stream to it, once a request used it

    @classmethod
    def connect(cls, address: str, tls: TlsFiles | None = None) -> "Replica":
        channel = aio_channel(address, tls, options=_CHANNEL_OPTIONS)  # calls are traced at the call (client_span)
        return cls(address, channel, engine_pb2_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel))

    @property
    def name(self) -> str:
        return self.replica_id or self.address

    async def close(self) -> None:
        if self.shared is not None:
            self.shared.close(f"the router dropped engine replica {self.name}")
        await self.channel.close()


class ReplicaSet:
    def __init__(self, addresses: list[str], check_interval_s: float = 1.0, forget_after_s: float = 30.0,
                 allow_joins: bool = False, max_joined: int = 64, tls: TlsFiles | None = None) -> None:
        self.replicas: dict[str, Replica] = {}  # by address
        self.tls = tls
        for address in addresses:
            self.add(address, static=True)
        self.check_interval_s = check_interval_s
        self.forget_after_s = forget_after_s
        self.allow_joins = allow_joins
        self.max_joined = max_joined
        self.num_refused = 0  # load reports from unknown replicas that were not let in
        self.on_down = lambda replica: None  # called when a replica stops being healthy
        self.on_forgotten = lambda replica: None  # called when a departed replica is dropped
        self.on_refused = lambda report: None  # called for each load report refused

    def add(self, address: str, static: bool = False) -> Replica:
        if address not in self.replicas:
            replica = Replica.connect(address, self.tls)
            replica.static, replica.down_since = static, time.monotonic()
            self.replicas[address] = replica
            log.info("engine replica %s added", address)
        return self.replicas[address]

    def _may_join(self, report: engine_pb2.LoadReport) -> bool:
        reason = None
        if not self.allow_joins:
            reason = "NATS is not authenticated, so only --engine-addrs are routed to"
        elif not report.address or report.address.startswith(("0.0.0.0:", "[::]:", ":")):
            reason = "its report names no address to dial"
        elif sum(1 for r in self.replicas.values() if not r.static) >= self.max_joined:
            reason = f"{self.max_joined} replicas joined already (--max-joined-replicas)"
        if reason is None:
            return True
        self.num_refused += 1
        self.on_refused(report)
        if self.num_refused <= 10 or self.num_refused % 1000 == 0:  # logged, but a flood does not flood the log
            log.warning("load report from unknown replica %r at %r refused (%d so far): %s", report.replica_id[:64],
                        report.address[:64], self.num_refused, reason)
        return False

    async def forget_departed(self) -> None:
        """Drops the replicas that joined by a report and have been down ``forget_after_s``."""
        now = time.monotonic()
        for replica in [r for r in self.replicas.values() if not r.static and not r.healthy
                        and r.down_since is not None and now - r.down_since > self.forget_after_s]:
            log.info("engine replica %s (%s) forgotten: down for %.0f s", replica.name, replica.address,
                     now - replica.down_since)
            del self.replicas[replica.address]
            self.on_down(replica)
            self.on_forgotten(replica)
            await replica.close()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def by_replica_id(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas.values() if r.replica_id == replica_id), None)

    def mark_down(self, replica: Replica, reason: str, unresponsive: bool = False) -> None:
        """Out of routing. ``unresponsive``: it answers nothing (paused, partitioned), so the requests waiting
        for its first output go elsewhere; a draining one still serves what it accepted."""
        if unresponsive:
            replica.unresponsive.set()
        if replica.healthy:
            log.warning("engine replica %s (%s) is down: %s", replica.name, replica.address, reason)
            replica.healthy = False
            replica.down_since = time.monotonic()
            self.on_down(replica)

    def apply_report(self, report: engine_pb2.LoadReport) -> None:
        replica = self.by_replica_id(report.replica_id) or self.replicas.get(report.address)
        if report.draining:
            if replica is not None:
                self.mark_down(replica, "draining (it finishes its running requests, then exits)")
            return
        if replica is None and report.address not in self.replicas:
            if not self._may_join(report):
                return
            replica = self.add(report.address)  # it is checked (health SERVING) before it is used
        if replica is not None:
            replica.num_waiting = report.num_waiting
            replica.load_at = time.monotonic()

    async def check(self, replica: Replica) -> None:
        """Health (and Info the first time), then Load if no fresh report came."""
        try:
            status = (await replica.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                self.mark_down(replica, "health is not SERVING")
                return
            info = await replica.stub.Info(engine_pb2.EngineInfoRequest(), timeout=2.0)
            if replica.replica_id and info.replica_id != replica.replica_id:
                self.on_down(replica)  # another engine process now: what it cached is gone
            replica.info, replica.replica_id = info, info.replica_id
            if time.monotonic() - replica.load_at > REPORT_FRESH_S:
                load = await replica.stub.Load(engine_pb2.LoadRequest(), timeout=1.0)
                replica.num_waiting = load.num_waiting
                replica.load_at = time.monotonic()
        except grpc.aio.AioRpcError as error:
            self.mark_down(replica, f"{error.code().name}: {error.details()}", unresponsive=True)
            return
        if not replica.healthy:
            log.info("engine replica %s (%s) is serving", replica.name, replica.address)
            replica.healthy, replica.down_since = True, None
            if replica.unresponsive.is_set():  # a new one; one never set stays, for whoever waits on it
                replica.unresponsive = asyncio.Event()

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas.values()))
