"""CLIENT spans (services.common.client_span) and SERVER spans (services.common.grpc_server) over a
real grpc.aio server on loopback: parent and child, the request id on both and on the server's log
lines, statuses, and no context left attached when a stream is closed from outside."""

import asyncio
import json
import logging

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from services.common import client_span, request_id
from services.common.errors import InvalidRequestError
from services.common.grpc_server import GrpcServer
from services.common.logging_setup import JsonFormatter, RequestContextFilter
from services.common.pb import engine_pb2, engine_pb2_grpc
from tests.common.spans import in_memory_exporter
from tests.waiting import until

GENERATE, LOAD = "strata.v1.Engine/Generate", "strata.v1.Engine/Load"
log = logging.getLogger("tests.fake_engine")
log.setLevel(logging.INFO)


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def Generate(self, request, context):
        """Small messages 10 ms apart; for request id "big", 400 kB ones as fast as they go out (a
        client that does not read leaves the stream waiting at a yield, on flow control)."""
        log.info("generating %s", request.request_id)
        big = request.request_id == "big"
        try:
            for i in range(100):
                yield engine_pb2.GenerateResponse(token_ids=[i] * (100_000 if big else 1))
                if not big:
                    await asyncio.sleep(0.01)
        finally:
            self.closed.set()

    async def Load(self, request, context):
        raise InvalidRequestError("no load today")


class Lines(logging.Handler):
    """Formats records as the services' JSON handler does."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestContextFilter())
        self.setFormatter(JsonFormatter("fake"))
        self.lines: list[dict] = []

    def emit(self, record) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture(scope="module")
def exporter():
    return in_memory_exporter()


def serve_and(scenario):
    """Runs ``scenario(stub, address, servicer)`` against a fresh server with a FakeEngine."""
    async def main():
        servicer = FakeEngine()
        server = GrpcServer(["strata.v1.Engine"], grace_s=0.5)
        engine_pb2_grpc.add_EngineServicer_to_server(servicer, server.server)
        address = f"127.0.0.1:{server.add_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                return await scenario(engine_pb2_grpc.EngineStub(channel), address, servicer)
        finally:
            await server.stop()

    return asyncio.run(main())


def test_a_call_in_a_trace_is_a_client_span_over_the_servers_span(exporter):
    exporter.clear()
    lines = Lines()
    log.addHandler(lines)

    async def scenario(stub, address, servicer):
        with trace.get_tracer("test").start_as_current_span("root") as root, request_id.bound("req-42"):
            call = client_span.call(GENERATE, address, lambda metadata: stub.Generate(
                engine_pb2.GenerateRequest(request_id="engine-side-id"), timeout=10, metadata=metadata))
            received = [await call.read() for _ in range(3)]
            call.cancel()  # as the gateway does once it has what it needs
        await asyncio.wait_for(servicer.closed.wait(), 5)
        return root, received

    try:
        root, received = serve_and(scenario)
    finally:
        log.removeHandler(lines)
    assert [list(r.token_ids) for r in received] == [[0], [1], [2]]
    spans = {span.kind: span for span in exporter.get_finished_spans() if span.name == GENERATE}
    client, server = spans[SpanKind.CLIENT], spans[SpanKind.SERVER]
    assert client.parent.span_id == root.get_span_context().span_id
    assert server.parent.span_id == client.context.span_id and server.context.trace_id == client.context.trace_id
    assert client.attributes["rpc.system"] == "grpc" and client.attributes["rpc.method"] == "Generate"
    assert client.attributes["server.address"] == "127.0.0.1" and client.attributes["server.port"] > 0
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    for span in (client, server):
        assert span.attributes["strata.request_id"] == "req-42"  # the caller's id, not the message's
    assert client.status.status_code is StatusCode.UNSET  # a cancel after what was needed is no failure
    line = next(line for line in lines.lines if line["message"] == "generating engine-side-id")
    assert line["request_id"] == "req-42" and line["service"] == "fake"
    assert line["trace_id"] == format(server.context.trace_id, "032x")
    assert line["span_id"] == format(server.context.span_id, "016x")


def test_a_failed_call_marks_both_spans_and_outside_a_trace_there_is_no_client_span(exporter):
    exporter.clear()

    async def scenario(stub, address, servicer):
        with trace.get_tracer("test").start_as_current_span("root"):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await client_span.call(LOAD, address, lambda metadata: stub.Load(
                    engine_pb2.LoadRequest(), timeout=10, metadata=metadata))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with request_id.bound("untraced-7"):
            call = client_span.call(GENERATE, address, lambda metadata: stub.Generate(
                engine_pb2.GenerateRequest(), timeout=10, metadata=metadata))
            await call.read()
            call.cancel()
        await asyncio.wait_for(servicer.closed.wait(), 5)
        # the client span ends once a task has read the call's status, the server's once its stream is closed
        await until(lambda: {(s.name, s.kind) for s in exporter.get_finished_spans()}
                    >= {(LOAD, SpanKind.CLIENT), (GENERATE, SpanKind.SERVER)})

    serve_and(scenario)
    spans = exporter.get_finished_spans()
    client = next(s for s in spans if s.name == LOAD and s.kind is SpanKind.CLIENT)
    server = next(s for s in spans if s.name == LOAD and s.kind is SpanKind.SERVER)
    assert client.status.status_code is StatusCode.ERROR and "INVALID_ARGUMENT" in client.status.description
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert server.status.status_code is StatusCode.ERROR and [e.name for e in server.events] == ["exception"]
    generate = [s for s in spans if s.name == GENERATE]
    assert [s.kind for s in generate] == [SpanKind.SERVER]  # no CLIENT span outside a trace
    assert generate[0].attributes["strata.request_id"] == "untraced-7"  # the id went along all the same


def test_a_stream_closed_from_outside_detaches_no_context(exporter, caplog):
    """A client that leaves while the servicer's stream waits at a yield, then the server stops: the
    stream is finalized elsewhere, which used to log ERROR "Failed to detach context"."""

    async def scenario(stub, address, servicer):
        call = stub.Generate(engine_pb2.GenerateRequest(request_id="big"), timeout=10)
        await call.read()
        # Part of the scenario, not a wait for a result: the time for the server to fill the
        # flow-control window and wait at a yield, then for the cancel to reach it there.
        await asyncio.sleep(0.2)
        call.cancel()
        await asyncio.sleep(0.2)

    with caplog.at_level(logging.WARNING):
        serve_and(scenario)
    assert not [r for r in caplog.records if r.name == "opentelemetry.context"], caplog.text
