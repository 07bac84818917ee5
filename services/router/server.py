"""The router's gRPC service: the same `strata.v1.Engine` as an engine, so the gateway does not know
whether one engine or a fleet answers.

``Generate`` asks `placement` for a replica (the policy over prefix overlap and load), and relays
that replica's stream; ``GenerateMany`` does the same for each request on one stream. Untraced
requests travel to a replica on the router's one ``GenerateMany`` stream to it (`Replica.shared`).

If the replica fails before the first output (UNAVAILABLE: down, draining, unreachable; it is marked
down), stops answering its health checks while the request waits for that output (hung: paused,
partitioned), or refuses it for a full queue (RESOURCE_EXHAUSTED), the request goes to another, up to
``max_attempts`` replicas (all full: RESOURCE_EXHAUSTED). After the first output a replica's failure,
or its health checks failing (a hung stream does not wait for the request's deadline), is the client's
to see as UNAVAILABLE, unless the request migrates (``--migration-limit``, `migration`): then it goes
on on another replica. An engine's own refusal (INVALID_ARGUMENT,
...) is passed on as it is. ``Info`` is a healthy replica's (with the router's id); ``Load`` sums the
healthy replicas'. Health is SERVING while at least one replica is.
"""

import asyncio
import contextlib
import logging
import time
import uuid

import grpc
from opentelemetry import trace

from services.common import client_span, error_details
from services.common.errors import ResourceExhaustedError, ServiceUnavailableError
from services.common.event_subjects import ALL_KV_EVENTS, ALL_LOAD_REPORTS
from services.common.generate_many import in_tasks, serve_generate_many
from services.common.grpc_server import GrpcServer
from services.common.nats_auth import connect_options, is_authenticated
from services.common.nats_logging import connection_callbacks
from services.common.pb import engine_pb2, engine_pb2_grpc, events_pb2
from services.common.shared_generate import SharedGenerate, SharedGenerateCall, status_error
from services.common.shared_stream import in_sampled_trace
from services.common.tls import TlsFiles
from services.router.metrics import RouterMetrics
from services.router.migration import Migration
from services.router.placement import Placement
from services.router.prefix_index import PrefixIndex
from services.router.replicas import Replica, ReplicaSet

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
GENERATE, LOAD = f"{SERVICE_NAME}/Generate", f"{SERVICE_NAME}/Load"
_RETRY_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)  # before the first output
_DOWN_ON = (grpc.StatusCode.UNAVAILABLE,)  # RESOURCE_EXHAUSTED: a full queue, not a dead replica
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")  # summed over every replica seen


# A stream whose replica failed a health check is cut only once it has also had no output for this
# long: a replica whose check timed out while it was busy, but that still streams, keeps its streams.
_STALL_S = 1.0


class ReplicaUnresponsive(Exception):
    """The replica's health check failed while an attempt waited for its output."""


class _Attempt:
    """One Generate call to one replica, read until the replica stops answering its health checks (hung:
    paused, partitioned), which answers neither the request nor the checks: the request must not wait
    for it until its deadline. Before the first output that ends the wait at once; after it, once the
    stream has also been quiet for ``_STALL_S``. A call on a shared stream is watched by one task for
    the whole attempt; another races each read with the health check."""

    def __init__(self, call, replica: Replica) -> None:
        self.call, self.replica = call, replica
        self.last_output: float | None = None  # when the latest output came; None before the first
        self._watch = asyncio.ensure_future(self._watch_shared()) if isinstance(call, SharedGenerateCall) else None

    async def read(self):
        """The call's next message (or EOF); raises `ReplicaUnresponsive` as above."""
        if self._watch is not None:
            output = await self.call.read()
        else:
            output = await self._read_racing()
        self.last_output = time.monotonic()
        return output

    def close(self) -> None:
        """Ends the call (an engine frees what it held for it) and the watch."""
        if self._watch is not None:
            self._watch.cancel()
        self.call.cancel()

    def _quiet_for(self) -> float:
        """How much longer the stream may stay quiet before it is cut (0: now). On a shared stream,
        outputs that came but were not read yet (the client reads slowly) keep it from being quiet."""
        if self.last_output is None:
            return 0.0
        if self._watch is not None and self.call.pending():
            return _STALL_S
        return max(0.0, self.last_output + _STALL_S - time.monotonic())

    def _hung(self) -> bool:
        """Whether the replica has failed its latest health check (a new, unset event once it recovers)."""
        return self.replica.unresponsive.is_set()

    async def _watch_shared(self) -> None:
        while True:
            await self.replica.unresponsive.wait()
            while self._hung() and (wait := self._quiet_for()) > 0:
                await asyncio.sleep(wait)
            if self._hung():
                break
        self.call.deliver(ReplicaUnresponsive(self.replica.address))

    async def _read_racing(self):
        read = asyncio.ensure_future(self.call.read())
        try:
            while not read.done():
                down = asyncio.ensure_future(self.replica.unresponsive.wait())
                try:
                    await asyncio.wait((read, down), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    down.cancel()
                if read.done() or (wait := self._quiet_for()) == 0:
                    break
                await asyncio.wait((read,), timeout=wait)  # then the replica is looked at again
        finally:
            if not read.done():
                read.cancel()
        if not read.done() or read.cancelled():
            raise ReplicaUnresponsive(self.replica.address)
        return read.result()


class RouterServicer(engine_pb2_grpc.EngineServicer):
    """The relay and its failover; where a request goes is `placement`'s."""

    def __init__(self, placement: Placement, router_id: str, max_attempts: int = 3,
                 request_timeout_s: float = 3600.0, metrics: RouterMetrics | None = None,
                 migration_limit: int = 0) -> None:
        self.placement = placement
        self.replicas = placement.replicas
        self.router_id = router_id
        self.max_attempts = max_attempts
        self.migration_limit = migration_limit
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics or RouterMetrics()
        self._counted: dict[str, engine_pb2.LoadReport] = {}  # each known replica's latest answer, see Load
        self._retired = engine_pb2.LoadReport()  # the counters of the replicas forgotten since
        self.replicas.on_forgotten = self._retire

    async def Generate(self, request: engine_pb2.GenerateRequest, context):
        if not request.request_id:  # as an engine names it; a shared stream to a replica keys requests by id
            named = engine_pb2.GenerateRequest()
            named.CopyFrom(request)
            named.request_id, request = uuid.uuid4().hex, named
        try:
            async with contextlib.aclosing(self._relay(request)) as outputs:  # closed (its call cancelled) at once
                async for output in outputs:
                    yield output
        except grpc.aio.AioRpcError as error:  # a replica's status (its refusal's details kept), or the cut
            await context.abort(error.code(), error.details(), trailing_metadata=error_details.passed_on(error))

    async def GenerateMany(self, request_iterator, context):
        """Many requests on one stream (`services/common/generate_many`), each placed and relayed as
        Generate places and relays it."""
        async for response in serve_generate_many(in_tasks(self._relay), request_iterator):
            yield response

    def _call(self, replica: Replica, request: engine_pb2.GenerateRequest):
        """The replica's outputs for ``request``: on the router's shared GenerateMany stream to it when
        it answers GenerateMany, the request is not traced and its id is not running there already;
        else on a Generate stream of its own (a CLIENT span of the request's trace)."""
        if replica.info is not None and replica.info.generate_many and not in_sampled_trace():
            if replica.shared is None:
                replica.shared = SharedGenerate(replica.stub.GenerateMany, replica.name, self.request_timeout_s)
            if not replica.shared.running(request.request_id):
                return replica.shared.generate(request)
        return client_span.call(GENERATE, replica.address, lambda metadata: replica.stub.Generate(
            request, timeout=self.request_timeout_s, metadata=metadata))

    async def _relay(self, request: engine_pb2.GenerateRequest):
        """``request``'s outputs from the replica that takes it, and, where the request migrates
        (`migration`), from the replicas that continue it; raises what its Generate call ends with
        (`grpc.aio.AioRpcError` for a replica's status or a cut, `services.common.errors` for none left)."""
        tried: set[str] = set()
        attempts = 0  # replicas tried for this request, or for its latest continuation
        full = False  # a replica refused for a full queue
        migration = Migration(request, self.migration_limit)
        cut: str | None = None  # the failure the latest continuation follows
        while True:
            picked = self.placement.pick(request, tried) if attempts < self.max_attempts else None
            if picked is None:
                if cut is not None:
                    raise status_error(grpc.StatusCode.UNAVAILABLE, f"{cut}; no other replica could continue it "
                                                                    f"({', '.join(sorted(tried))}); the output is incomplete")
                if full:
                    raise ResourceExhaustedError(f"every engine replica tried is at capacity "
                                                 f"({', '.join(sorted(tried))}); retry later")
                raise ServiceUnavailableError("no engine replica is available" if not tried else
                                              f"every engine replica tried failed ({', '.join(sorted(tried))})")
            replica, overlap = picked
            tried.add(replica.address)
            attempts += 1
            span = trace.get_current_span()
            span.set_attributes({"strata.router.replica": replica.name, "strata.router.prefix_overlap": overlap,
                                 "strata.router.attempt": len(tried)})
            span.add_event("attempt", {"strata.router.replica": replica.name, "strata.router.attempt": len(tried),
                                       "strata.router.prefix_overlap": overlap})
            self.metrics.routed.labels(replica.name).inc()
            self.metrics.overlap.observe(overlap)
            replica.in_flight += 1
            self.metrics.in_flight.labels(replica.name).set(replica.in_flight)
            attempt = _Attempt(self._call(replica, request), replica)
            relayed = False
            failure: tuple[grpc.StatusCode, str] | None = None  # how the replica failed after relaying outputs
            try:
                output = await attempt.read()
                while output is not grpc.aio.EOF:
                    relayed = True
                    yield migration.relayed(output)
                    if output.finish_reason:  # done: not waiting for the stream's end, which the caller
                        return  # may cancel as soon as it has this last message
                    output = await attempt.read()
                return
            except ReplicaUnresponsive:  # hung (paused, partitioned): its health check failed while we waited
                span.add_event("attempt failed", {"strata.router.replica": replica.name,
                                                  "strata.router.error": "unresponsive"})
                if relayed:
                    failure = (grpc.StatusCode.UNAVAILABLE, "it stopped answering its health checks")
                else:
                    self.metrics.failovers.labels(replica.name).inc()
                    log.warning("request %s: replica %s stopped answering health checks before its first output; "
                                "trying another", request.request_id, replica.name)
            except grpc.aio.AioRpcError as error:
                span.add_event("attempt failed", {"strata.router.replica": replica.name,
                                                  "rpc.grpc.status_code": error.code().value[0],
                                                  "strata.router.error": error.details() or ""})
                if error.code() in _DOWN_ON:
                    self.replicas.mark_down(replica, f"Generate failed: {error.code().name}: {error.details()}")
                full = full or error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                if relayed:
                    failure = (error.code(), error.details())
                elif error.code() not in _RETRY_ON:  # the engine's own refusal, its status details kept
                    raise
                else:
                    self.metrics.failovers.labels(replica.name).inc()
                    log.warning("request %s: replica %s refused or failed before its first output (%s); "
                                "trying another", request.request_id, replica.name, error.code().name)
            finally:
                attempt.close()  # a client that left, or a relay cut short, frees the engine's blocks
                replica.in_flight -= 1
                self.metrics.in_flight.labels(replica.name).set(replica.in_flight)
            if failure is not None:  # outputs already went out: the request goes on elsewhere, or the client sees the cut
                cut = f"engine replica {replica.name} failed mid-stream ({failure[1]})"
                request, attempts = self._continuation(migration, replica, *failure, cut), 0

    def _continuation(self, migration: Migration, replica: Replica, code: grpc.StatusCode, details: str,
                      cut: str) -> engine_pb2.GenerateRequest:
        """The rest of a request whose replica failed after relaying outputs; raises the cut, for the
        client to see, where the request does not migrate."""
        refusal = migration.refusal() if code in _DOWN_ON else "not a replica failure"
        if refusal is not None:
            why = f" (not continued elsewhere: {refusal})" if self.migration_limit else ""
            raise status_error(code, f"{cut}; the output is incomplete{why}")
        rest = migration.continuation()
        self.metrics.migrations.labels(replica.name).inc()
        trace.get_current_span().add_event("migrated", {"strata.router.replica": replica.name,
                                                        "strata.router.migration": migration.count,
                                                        "strata.router.tokens_relayed": len(migration.generated)})
        log.warning("request %s: replica %s failed after %d tokens (%s: %s); continuing it on another "
                    "(migration %d of %d)", rest.request_id, replica.name, len(migration.generated), code.name,
                    details, migration.count, migration.limit)
        return rest

    async def Info(self, request, context) -> engine_pb2.EngineInfoResponse:
        known = [r for r in self.replicas.healthy() if r.info is not None]
        if not known:
            raise ServiceUnavailableError("no engine replica is available")
        info = engine_pb2.EngineInfoResponse()
        info.CopyFrom(known[0].info)
        info.replica_id = self.router_id
        info.generate_many = True  # each request on a GenerateMany stream is placed and relayed on its own
        info.num_kv_blocks = sum(r.info.num_kv_blocks for r in known)
        info.max_num_seqs = sum(r.info.max_num_seqs for r in known)
        return info

    async def Load(self, request, context) -> engine_pb2.LoadReport:
        loads = await asyncio.gather(*(client_span.call(LOAD, r.address, lambda metadata, stub=r.stub: stub.Load(
            engine_pb2.LoadRequest(), timeout=2.0, metadata=metadata)) for r in self.replicas.healthy()),
                                     return_exceptions=True)
        return self._fleet_load([load for load in loads if isinstance(load, engine_pb2.LoadReport)])

    def _fleet_load(self, answers: list[engine_pb2.LoadReport]) -> engine_pb2.LoadReport:
        """The fleet as one replica: what runs, waits and is cached now, summed over the replicas that
        answered; the counters (prefix-cache queries and hits, preemptions) summed over every replica
        that ever answered, each at its latest count, so that the total never goes backwards when a
        replica stops answering (an unhealthy or departed replica's work still happened)."""
        total = engine_pb2.LoadReport(replica_id=self.router_id, timestamp_ns=time.time_ns())
        for load in answers:
            for field in ("num_running", "num_waiting", "num_kv_blocks_used", "num_kv_blocks_total", "max_num_seqs"):
                setattr(total, field, getattr(total, field) + getattr(load, field))
            self._counted[load.replica_id or load.address] = load
        for load in (self._retired, *self._counted.values()):
            for field in _COUNTERS:
                setattr(total, field, getattr(total, field) + getattr(load, field))
        return total

    def _retire(self, replica: Replica) -> None:
        """A forgotten replica's last counts stay in the fleet's counters, without an entry of its own
        (replicas that come and go, as under an autoscaler, would grow the table for ever)."""
        for key in {replica.replica_id, replica.address} - {""}:
            load = self._counted.pop(key, None)
            if load is not None:
                for field in _COUNTERS:
                    setattr(self._retired, field, getattr(self._retired, field) + getattr(load, field))


async def subscribe_events(nats_url: str, replicas: ReplicaSet, index: PrefixIndex):
    """Feeds KV events to the index and load reports to the replicas; returns the NATS connection."""
    import nats

    async def on_kv_events(message) -> None:
        index.apply(events_pb2.KvEventBatch.FromString(message.data))

    async def on_load_report(message) -> None:
        replicas.apply_report(engine_pb2.LoadReport.FromString(message.data))

    connection = await nats.connect(nats_url, name="strata-router", max_reconnect_attempts=-1,
                                    reconnect_time_wait=0.5, **connection_callbacks("strata-router"),
                                    **connect_options())
    await connection.subscribe(ALL_KV_EVENTS, cb=on_kv_events)
    await connection.subscribe(ALL_LOAD_REPORTS, cb=on_load_report)
    log.info("following KV events and load reports on NATS at %s", nats_url)
    return connection


async def serve(host: str, port: int, engine_addrs: list[str], nats_url: str | None, router_id: str,
                hash_seed: int, check_interval_s: float, max_attempts: int, policy: str = "cache-aware",
                metrics_port: int | None = None, forget_after_s: float = 30.0, max_joined: int = 64,
                shutdown_timeout_s: float = 60.0, tls: TlsFiles | None = None, migration_limit: int = 0) -> None:
    """Serves until SIGTERM/SIGINT."""
    index = PrefixIndex()
    allow_joins = nats_url is not None and is_authenticated(nats_url)
    replicas = ReplicaSet(engine_addrs, check_interval_s, forget_after_s, allow_joins, max_joined, tls)
    if nats_url is not None and not allow_joins:
        log.warning("NATS at %s without credentials: replicas may not join by their load reports "
                    "(set STRATA_NATS_TOKEN); routing to --engine-addrs only", nats_url)
    replicas.on_down = lambda replica: index.forget(replica.replica_id)
    metrics = RouterMetrics()
    replicas.on_refused = lambda report: metrics.refused_reports.inc()
    if metrics_port is not None:
        metrics.start_http_server(host, metrics_port)
    servicer = RouterServicer(Placement(replicas, index, hash_seed, policy), router_id, max_attempts, metrics=metrics,
                              migration_limit=migration_limit)
    server = GrpcServer([SERVICE_NAME], grace_s=shutdown_timeout_s)
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server.server)
    bound = server.add_port(f"{host}:{port}", tls)
    await server.start()
    log.info("router %s listening on %s:%d for %d engine replica(s)", router_id, host, bound, len(engine_addrs))
    connection = await subscribe_events(nats_url, replicas, index) if nats_url else None
    checks = asyncio.create_task(_check_and_report(replicas, server, index, metrics))
    try:
        await server.wait_for_termination()
    finally:
        checks.cancel()
        if connection is not None:
            await connection.close()
        await replicas.close()


async def _check_and_report(replicas: ReplicaSet, server: GrpcServer, index: PrefixIndex,
                            metrics: RouterMetrics) -> None:
    """Checks the replicas forever; the router is SERVING while any of them is."""
    serving = None
    while True:
        await asyncio.gather(*(replicas.check(r) for r in list(replicas.replicas.values())))
        await replicas.forget_departed()
        metrics.replicas.set(len(replicas.replicas))
        metrics.keep_only({replica.name for replica in replicas.replicas.values()})
        for replica in replicas.replicas.values():
            metrics.healthy.labels(replica.name).set(1 if replica.healthy else 0)
            metrics.index_blocks.labels(replica.name).set(index.num_blocks(replica.replica_id))
        now_serving = bool(replicas.healthy())
        if now_serving != serving:
            await server.set_serving(now_serving)
            serving = now_serving
        await asyncio.sleep(replicas.check_interval_s)
