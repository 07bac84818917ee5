"""The engine's gRPC service (`strata.v1.Engine`): a thin layer over `AsyncEngine`.

Health is NOT_SERVING while the model loads and warms up, SERVING after, and NOT_SERVING again once
a shutdown began; then new requests get UNAVAILABLE while in-flight ones finish (up to
`shutdown_timeout_s`). Errors become status codes in `services.common.grpc_server`, not here.
"""

import asyncio
import functools
import logging
import signal
import socket
import threading
import time
import uuid

import uvloop
from opentelemetry import trace

from services.common import request_id as request_ids
from services.common.errors import ServiceUnavailableError
from services.common.gc_heap import freeze_startup_heap
from services.common.generate_many import Replies, serve_generate_many
from services.common.grpc_server import GrpcServer
from services.common.pb import engine_pb2, engine_pb2_grpc
from services.common.tls import TlsFiles
from services.engine.async_engine import AsyncEngine, SubmittedRequest
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.metrics import EngineMetrics
from services.engine.nats_events import EngineEvents
from services.engine.protocol import (
    fill_response,
    follows_as_next_token,
    load_report,
    output_to_proto,
    sampling_params_from_proto,
)
from services.engine.request import RequestTimes
from services.engine.scheduler_output import RequestOutput
from services.engine.stats_logger import StatsLogger
from services.engine.step_tracing import StepTracer
from services.engine.threads import openmp_wait_description, set_num_threads

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, config: EngineConfig, served_model_name: str) -> None:
        self.config = config
        self.served_model_name = served_model_name
        self.engine: AsyncEngine | None = None
        self.accepting = False
        self._fill = functools.partial(fill_response, replica_id=config.replica_id)

    def _ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise ServiceUnavailableError("the engine is still loading the model")
        if not self.accepting:
            raise ServiceUnavailableError("the engine is shutting down")
        return self.engine

    async def Generate(self, request: engine_pb2.GenerateRequest, context):
        engine = self._ready_engine()
        params = sampling_params_from_proto(request, engine.core.generation_defaults.sampling)
        request_id = request.request_id or uuid.uuid4().hex
        span = trace.get_current_span()  # the RPC's span (grpc_server's tracing interceptor)
        # strata.request_id (the client's x-request-id, else this id) is set by grpc_server's interceptor
        span.set_attributes({"strata.engine_request_id": request_id, "strata.replica_id": self.config.replica_id,
                             "gen_ai.usage.input_tokens": len(request.prompt_token_ids)})
        first = True
        async for output in engine.generate(request_id, list(request.prompt_token_ids), params, request.cache_salt,
                                            request.fairness_key, span.get_span_context()):
            times = output.times
            if first:
                _add_stage_events(span, times)
                first = False
            if output.finish_reason is not None:
                span.set_attributes({"gen_ai.response.finish_reasons": (output.finish_reason,),
                                     "gen_ai.usage.output_tokens": output.num_output_tokens,
                                     "strata.cached_prompt_tokens": max(output.num_cached_tokens, 0),
                                     "strata.decode_time_s": times.decode_s,
                                     "strata.inference_time_s": times.inference_s})
            yield output_to_proto(output, self.config.replica_id)

    async def GenerateMany(self, request_iterator, context):
        async for response in serve_generate_many(self._start_one_of_many, request_iterator):
            yield response

    def _start_one_of_many(self, request: engine_pb2.GenerateRequest, replies: Replies) -> SubmittedRequest:
        """Starts a GenerateMany request (`services/common/generate_many`): as Generate's, untraced; each
        output goes to ``replies`` from the engine loop's callback, without a task of the request's own."""
        fill = self._fill
        previous = None  # the request's last output passed on

        def on_output(output: RequestOutput | BaseException) -> None:
            nonlocal previous
            if isinstance(output, BaseException):
                replies.fail(output)
                return
            if replies.next_token_entries and follows_as_next_token(output, previous):
                replies.next_token(output.new_token_ids[0])
            else:
                replies.output_with(fill, output)  # written into the stream's next message as it is built
            previous = output
            if output.finished:
                replies.end()

        with request_ids.bound(request.request_id):  # its log lines carry its id, as a Generate call's do
            engine = self._ready_engine()
            params = sampling_params_from_proto(request, engine.core.generation_defaults.sampling)
            return engine.submit(request.request_id, list(request.prompt_token_ids), params, on_output,
                                 request.cache_salt, request.fairness_key)

    async def Info(self, request: engine_pb2.EngineInfoRequest, context) -> engine_pb2.EngineInfoResponse:
        if self.engine is None:
            raise ServiceUnavailableError("the engine is still loading the model")
        core = self.engine.core
        return engine_pb2.EngineInfoResponse(
            model=self.served_model_name, max_model_len=core.max_model_len, vocab_size=core.vocab_size,
            block_size=self.config.block_size, num_kv_blocks=core.num_kv_blocks,
            replica_id=self.config.replica_id, max_num_seqs=self.config.max_num_seqs,
            dtype=str(core.model_runner.dtype).removeprefix("torch."), device=self.config.device,
            prefix_caching=self.config.enable_prefix_caching, max_logprobs=self.config.max_logprobs,
            generate_many=True, default_max_tokens=core.generation_defaults.max_tokens,
            default_temperature=core.generation_defaults.sampling.get("temperature"),
        )

    async def Load(self, request: engine_pb2.LoadRequest, context) -> engine_pb2.LoadReport:
        if self.engine is None:
            return engine_pb2.LoadReport(replica_id=self.config.replica_id, max_num_seqs=self.config.max_num_seqs)
        return load_report(self.config.replica_id, self.engine.stats, self.config.max_num_seqs,
                           draining=not self.accepting)


def _add_stage_events(span: trace.Span, times: RequestTimes) -> None:
    """The request's engine stages up to its first token on ``span``: events ``queued`` (arrival),
    ``scheduled`` (first scheduled) and ``first_token`` at the times they happened, and their
    durations as attributes (decode and inference times follow at the finish)."""
    monotonic_to_wall_ns = time.time_ns() - time.monotonic_ns()
    for name, at in (("queued", times.arrival), ("scheduled", times.first_scheduled),
                     ("first_token", times.first_token)):
        span.add_event(name, timestamp=monotonic_to_wall_ns + round(at * 1e9))
    span.set_attributes({"strata.queue_time_s": times.queue_s, "strata.prefill_time_s": times.prefill_s})


def run_server(config: EngineConfig, host: str, port: int, served_model_name: str,
               shutdown_timeout_s: float, metrics_port: int | None, nats_url: str | None = None,
               load_report_interval_s: float = 1.0, advertise_address: str | None = None,
               tls: TlsFiles | None = None, log_stats_interval_s: float | None = 10.0,
               trace_steps_sample: float | None = None) -> None:
    """Serves until SIGTERM/SIGINT. While this (main) thread loads the model, the gRPC server runs on
    its event loop in a background thread (health: NOT_SERVING); once the model is loaded, that loop
    moves to this thread and runs the engine loop beside the server (`AsyncEngine.drive`). With
    ``nats_url``, KV events and load reports go to NATS (see `nats_events`); with
    ``log_stats_interval_s``, a stats line is logged that often while there is traffic (`stats_logger`);
    with ``trace_steps_sample``, that fraction of the steps get a span (`step_tracing`)."""
    metrics = EngineMetrics(served_model_name, config.replica_id)
    stats_logger = StatsLogger(config.replica_id, log_stats_interval_s) if log_stats_interval_s else None
    if metrics_port is not None:
        metrics.start_http_server(host, metrics_port)
    loop = uvloop.new_event_loop()
    servicer = EngineServicer(config, served_model_name)
    events = (EngineEvents(config.replica_id, config.block_size, config.max_num_seqs, nats_url, load_report_interval_s)
              if nats_url else None)
    serving = _GrpcServing(servicer, host, port, shutdown_timeout_s, events, tls, stats_logger, advertise_address)
    loading_thread = threading.Thread(target=loop.run_until_complete, name="grpc-while-loading",
                                      args=(serving.start(),))
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()
        loop.call_soon_threadsafe(serving.stop_requested.set)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loading_thread.start()
    log.info("engine %s: %s%d kernel threads, OpenMP wait %s", config.replica_id,
             "" if config.num_threads else "up to ", set_num_threads(config.num_threads),
             openmp_wait_description())
    try:
        core = EngineCore(config, event_sink=events.buffer if events else None)
        core.warmup()
    except BaseException:  # a bad checkpoint or flag, no memory: the process ends with the error
        loop.call_soon_threadsafe(serving.stop_requested.set)  # instead of serving NOT_SERVING forever
        loading_thread.join()
        loop.run_until_complete(serving.finish())
        raise
    if not stopping.is_set():
        observe_step = _both(metrics.observe_step, stats_logger.observe_step) if stats_logger else metrics.observe_step
        metrics.on_catch_up(lambda: metrics.observe_structured_output(*core.structured_output.take_stats()))
        step_tracer = StepTracer(trace_steps_sample, config.replica_id) if trace_steps_sample else None
        servicer.engine = engine = AsyncEngine(core, on_step=events.after_step(observe_step) if events else observe_step,
                                               step_tracer=step_tracer)
        metrics.on_catch_up(lambda: metrics.observe_load(engine.stats))  # the load now, not the last step's
        freeze_startup_heap(f"engine {config.replica_id}")
    loop.call_soon_threadsafe(serving.loaded.set)
    loading_thread.join()  # serving.start() returns once the model is loaded (or a stop came first)
    loop.run_until_complete(serving.finish())


def _both(first, second):
    def both(*args) -> None:
        first(*args)
        second(*args)

    return both


async def _drain(engine: AsyncEngine, timeout_s: float) -> None:
    """Waits for the running requests to finish; at the timeout, ends the rest with UNAVAILABLE (a
    router moves one that had produced nothing yet to another replica; a started stream sees an
    error) and gives their streams a moment to carry that out."""
    try:
        await asyncio.wait_for(engine.wait_until_idle(), timeout_s)
        return
    except TimeoutError:
        pass
    log.warning("drain timed out after %.0f s: aborting %d request(s)", timeout_s, engine.num_active_requests)
    engine.abort_all(ServiceUnavailableError(
        f"the engine replica stopped before the request finished (its drain timed out after {timeout_s:g} s)"))
    try:
        await asyncio.wait_for(engine.wait_until_idle(), 2.0)
    except TimeoutError:
        pass


def _reachable_address(host: str, port: int, advertise: str | None = None) -> str:
    """Where others can reach this server: ``advertise`` (--advertise-address) when given, else the
    listen address, where a wildcard names this host instead; an IPv6 address in brackets."""
    name = advertise or (socket.getfqdn() if host in ("", "0.0.0.0", "::", "[::]") else host)
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return f"{name}:{port}"


class _GrpcServing:
    """The engine's gRPC server over its life, on one event loop: `start()` serves (NOT_SERVING) until
    the model is loaded, in a thread of its own while the main thread loads; then `finish()`, on the
    main thread, serves with the engine loop beside it (`AsyncEngine.drive`) until a stop, drains
    and stops. A stop before the model is loaded stops the server at once."""

    def __init__(self, servicer: EngineServicer, host: str, port: int, shutdown_timeout_s: float,
                 events: EngineEvents | None, tls: TlsFiles | None, stats_logger: StatsLogger | None,
                 advertise_address: str | None) -> None:
        self.servicer, self.host, self.port, self.shutdown_timeout_s = servicer, host, port, shutdown_timeout_s
        self.events, self.tls, self.stats_logger, self.advertise_address = events, tls, stats_logger, advertise_address
        self.stop_requested = asyncio.Event()
        self.loaded = asyncio.Event()  # set once the model is loaded, or its loading failed
        self.server: GrpcServer | None = None  # while it serves
        self.bound_port = 0

    async def start(self) -> None:
        config = self.servicer.config
        server = self.server = GrpcServer([SERVICE_NAME], grace_s=2.0, options=GRPC_OPTIONS)
        engine_pb2_grpc.add_EngineServicer_to_server(self.servicer, server.server)
        self.bound_port = server.add_port(f"{self.host}:{self.port}", self.tls)
        await server.start()
        if self.events is not None:
            self.events.connect()
        log.info("engine %s listening on %s:%d; loading %s", config.replica_id, self.host, self.bound_port,
                 config.model)
        loaded, stop = asyncio.create_task(self.loaded.wait()), asyncio.create_task(self.stop_requested.wait())
        await asyncio.wait([loaded, stop], return_when=asyncio.FIRST_COMPLETED)
        for waiter in (loaded, stop):  # a stop during loading leaves `loaded` pending: no "Task was destroyed"
            waiter.cancel()
        if self.stop_requested.is_set():
            await self._stop_before_ready()

    async def finish(self) -> None:
        engine = self.servicer.engine
        if self.server is None:  # stopped in start()
            return
        if engine is None or self.stop_requested.is_set():  # a stop came as the model finished loading
            await self._stop_before_ready()
            return
        config, events = self.servicer.config, self.events
        driving = asyncio.create_task(engine.drive())
        self.servicer.accepting = True
        await self.server.set_serving()
        log.info("engine %s ready: %d KV blocks of %d tokens, max model len %d", config.replica_id,
                 engine.core.num_kv_blocks, config.block_size, engine.core.max_model_len)
        stats_lines = (asyncio.create_task(self.stats_logger.run(lambda: engine.stats))
                       if self.stats_logger is not None else None)
        if events is not None:
            events.start_reports(_reachable_address(self.host, self.bound_port, self.advertise_address),
                                 lambda: engine.stats)
        stop = asyncio.create_task(self.stop_requested.wait())
        await asyncio.wait([stop, driving], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if driving.done():  # the engine loop itself failed (a bug): stop serving, and say why
            log.error("the engine loop stopped: %r; stopping", driving.exception())
        else:
            log.info("draining: no new requests; waiting up to %.0f s for the %d in flight", self.shutdown_timeout_s,
                     engine.num_active_requests)
        if stats_lines is not None:
            stats_lines.cancel()
        await self._stop(engine, driving)
        driving.result()  # the engine loop's failure, if that is why it stopped

    async def _stop_before_ready(self) -> None:
        log.info("stopping before the model was ready")
        await self._stop(None)

    async def _stop(self, engine: AsyncEngine | None, driving: asyncio.Task | None = None) -> None:
        """Refuses new requests, drains the running ones (up to the shutdown timeout), stops."""
        self.servicer.accepting = False
        await self.server.set_serving(False)
        if self.events is not None and engine is not None:
            self.events.announce_draining(engine.stats)
        if driving is not None and not driving.done():
            await _drain(engine, self.shutdown_timeout_s)
        await self.server.stop()
        self.server = None
        if driving is not None and not driving.done():
            engine.shutdown()
            await driving
        if self.events is not None:
            await self.events.close()
