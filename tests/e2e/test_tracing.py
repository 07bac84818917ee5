"""One request is one trace: the gateway's HTTP span and the tokenizer's and the engine's gRPC spans,
exported by each service process over OTLP to a real OTLP/gRPC receiver, linked parent to child,
continuing the client's own ``traceparent`` when it sends one."""

import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.launcher import Stack, StackConfig, StartupError, find_free_port
from tests.e2e.conftest import MODEL

GATEWAY, TOKENIZER, ENGINE = "strata-gateway", "strata-tokenizer", "strata-engine"
ROOT, GENERATE = "POST /v1/chat/completions", "strata.v1.Engine/Generate"
ENCODE_CHAT, DETOKENIZE = "strata.v1.Tokenizer/EncodeChat", "strata.v1.Tokenizer/Detokenize"
EXPECTED = {ROOT, GENERATE, ENCODE_CHAT, DETOKENIZE}


@dataclass
class ExportedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: list[str]
    is_error: bool


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ExportedSpan] = []

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attributes = {a.key: _value(a.value) for a in span.attributes}
                        self._spans.append(ExportedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(),
                                                        span.parent_span_id.hex(), attributes,
                                                        [event.name for event in span.events],
                                                        span.status.code == span.status.STATUS_CODE_ERROR))
        return trace_service_pb2.ExportTraceServiceResponse()

    def all_spans(self) -> list[ExportedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, names: set[str], trace_id: str | None = None, timeout_s: float = 20.0,
                 **attributes) -> list[ExportedSpan]:
        """The spans of a trace once spans of every name in ``names`` are in (or after ``timeout_s``): of
        ``trace_id``, or of the trace of the first span that has ``attributes``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.all_spans()
            if trace_id is None:
                trace_id = next((s.trace_id for s in spans
                                 if all(s.attributes.get(k) == v for k, v in attributes.items())), None)
            spans = [s for s in spans if s.trace_id == trace_id]
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture(scope="module")
def traced_stack(default_model_dir, tmp_path_factory):
    # The receiver starts after the services: forking (to spawn them) while a gRPC server runs in
    # this process breaks the children's gRPC. The services send nothing before the first request.
    port = find_free_port()
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), served_model_name=MODEL,
                         engine_args=["--max-num-seqs", "4", "--num-kv-blocks", "64", "--enforce-eager"],
                         gateway_args=["--log-level", "warning"], log_dir=tmp_path_factory.mktemp("traced-logs"),
                         echo_logs=False, startup_timeout_s=120, grace_s=5)
    stack = Stack(config)
    with pytest.MonkeyPatch.context() as env:  # the services read these when they start
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        try:
            stack.start()
        except StartupError as error:
            pytest.fail(f"the stack did not start: {error}")
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    yield stack, receiver
    stack.stop()
    server.stop(None)


def chat(stack, headers: dict, stream: bool, status: int = 200, **fields) -> dict | str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream,
            **fields}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == status
    return response.text if stream else response.json()


def test_a_streamed_request_is_one_trace_under_the_clients_span(traced_stack):
    stack, receiver = traced_stack
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    chat(stack, {"traceparent": f"00-{trace_id}-{client_span_id}-01"}, stream=True)
    spans = receiver.wait_for(EXPECTED, trace_id)
    by_name = {s.name: s for s in spans}
    root = by_name[ROOT]
    assert root.service == GATEWAY and root.parent_id == client_span_id
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == MODEL and root.attributes["gen_ai.usage.output_tokens"] == 5
    generate = by_name[GENERATE]
    assert generate.service == ENGINE and generate.parent_id == root.span_id
    assert generate.attributes["gen_ai.usage.output_tokens"] == 5
    assert generate.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert generate.events == ["queued", "scheduled", "first_token"]  # the engine's stages, in order
    assert generate.attributes["strata.queue_time_s"] >= 0 and generate.attributes["strata.decode_time_s"] > 0
    for name in (ENCODE_CHAT, DETOKENIZE):
        assert by_name[name].service == TOKENIZER and by_name[name].parent_id == root.span_id


def test_without_a_traceparent_the_gateway_starts_the_trace(traced_stack):
    stack, receiver = traced_stack
    assert httpx.get(f"{stack.base_url}/health", timeout=10).status_code == 200  # a probe: not traced
    request_id = secrets.token_hex(8)
    result = chat(stack, {"x-request-id": request_id}, stream=False)
    assert result["usage"]["completion_tokens"] == 5
    spans = receiver.wait_for(EXPECTED, **{"strata.request_id": request_id})
    root = next(s for s in spans if s.name == ROOT)
    assert root.parent_id == "" and root.attributes["strata.response_id"] == result["id"]
    assert {s.service for s in spans} == {GATEWAY, TOKENIZER, ENGINE}
    assert all(s.parent_id == root.span_id for s in spans if s is not root)
    assert not any(s.name.endswith("/health") for s in receiver.all_spans())


def test_a_refused_request_marks_the_failing_hop(traced_stack):
    stack, receiver = traced_stack
    trace_id = secrets.token_hex(16)
    chat(stack, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}, stream=False, status=400,
         chat_template="{% for %}")  # the tokenizer cannot compile it: INVALID_ARGUMENT
    spans = {s.name: s for s in receiver.wait_for({ROOT, ENCODE_CHAT}, trace_id)}
    assert spans[ENCODE_CHAT].is_error and "exception" in spans[ENCODE_CHAT].events
    assert spans[ROOT].attributes["http.response.status_code"] == 400 and not spans[ROOT].is_error


def test_polling_calls_make_no_traces_of_their_own(traced_stack):
    """A router's checks (Info, Load every second) and /metrics scrapes are not traces; an Info
    inside a caller's trace still is a span of it."""
    stack, receiver = traced_stack
    from services.common.pb import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(stack.engine_addr) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for _ in range(5):
            stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)
            stub.Load(engine_pb2.LoadRequest(), timeout=5)
        trace_id = secrets.token_hex(16)
        stub.Info(engine_pb2.EngineInfoRequest(), timeout=5,
                  metadata=(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),))
    spans = receiver.wait_for({"strata.v1.Engine/Info"}, trace_id=trace_id)
    assert [s.name for s in spans] == ["strata.v1.Engine/Info"]
    polled = [s for s in receiver.all_spans() if s.name in ("strata.v1.Engine/Info", "strata.v1.Engine/Load")]
    assert all(s.parent_id for s in polled), "polling calls outside a trace were traced as roots"
