"""One request is one trace across gateway, tokenizer, router and engine, exported by each service
process over OTLP to a real OTLP/gRPC receiver: a CLIENT span for every outgoing call with the
callee's SERVER span under it, the GenAI conventions on the root, the trace id back to the client
(``traceresponse``), the client's ``x-request-id`` on every span and log line; under load on one
seat per engine, a queued request's wait on its engine span and in the engine's queue-time
histogram, no ERROR span, and step spans linked to the requests they served; and the same stack's
logs: JSON from every service, the engines' stats lines, and a shutdown without an error or traceback.

The stack (two engines of one seat each, with step spans, behind a router, NATS) logs in JSON; its
last test stops it."""

import json
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from services.common.service_identity import version
from services.launcher import Stack, StackConfig, StartupError, find_free_port
from tests.e2e.conftest import MODEL

GATEWAY, TOKENIZER, ROUTER, ENGINE = "strata-gateway", "strata-tokenizer", "strata-router", "strata-engine"
ROOT, GENERATE = "POST /v1/chat/completions", "strata.v1.Engine/Generate"
ENCODE_CHAT = "strata.v1.Tokenizer/EncodeChat"
STEP = "engine.step"
CLIENT, SERVER = "CLIENT", "SERVER"
# (service, span name, kind) of one chat request's spans
EXPECTED = {(GATEWAY, ROOT, SERVER),
            (GATEWAY, ENCODE_CHAT, CLIENT), (TOKENIZER, ENCODE_CHAT, SERVER),
            (GATEWAY, GENERATE, CLIENT), (ROUTER, GENERATE, SERVER),
            (ROUTER, GENERATE, CLIENT), (ENGINE, GENERATE, SERVER)}


@dataclass
class ExportedSpan:
    resource: dict
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: list[str]
    is_error: bool
    event_times: dict[str, int] = field(default_factory=dict)  # by event name, ns since the epoch
    links: list[tuple[str, str, dict]] = field(default_factory=list)  # (trace id, span id, attributes)
    start_ns: int = 0

    @property
    def service(self) -> str:
        return self.resource["service.name"]

    @property
    def key(self) -> tuple[str, str, str]:
        return self.service, self.name, self.kind


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ExportedSpan] = []

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attributes = {a.key: _value(a.value) for a in span.attributes}
                        self._spans.append(ExportedSpan(
                            resource, span.name, trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                            span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), attributes,
                            [event.name for event in span.events], span.status.code == span.status.STATUS_CODE_ERROR,
                            {event.name: event.time_unix_nano for event in span.events},
                            [(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                             for link in span.links], span.start_time_unix_nano))
        return trace_service_pb2.ExportTraceServiceResponse()

    def all_spans(self) -> list[ExportedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, keys: set[tuple[str, str, str]], trace_id: str, timeout_s: float = 20.0) -> list[ExportedSpan]:
        """The spans of ``trace_id`` once one of each (service, name, kind) in ``keys`` is in (or after
        ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = [s for s in self.all_spans() if s.trace_id == trace_id]
            if keys <= {s.key for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _attributes(attributes) -> dict:
    return {a.key: _value(a.value) for a in attributes}


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
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), served_model_name=MODEL, replicas=2,
                         engine_args=["--max-num-seqs", "1", "--num-kv-blocks", "64", "--enforce-eager",
                                      "--log-stats-interval", "1", "--trace-steps"],
                         log_format="json", log_dir=tmp_path_factory.mktemp("traced-logs"),
                         echo_logs=False, startup_timeout_s=120, grace_s=10)
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


def chat(stack, headers: dict, stream: bool, status: int = 200, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream,
            **fields}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    return response


def traceresponse(response: httpx.Response) -> tuple[str, str]:
    """The trace id and the gateway's span id from the ``traceresponse`` header."""
    version_, trace_id, span_id, flags = response.headers["traceresponse"].split("-")
    assert version_ == "00" and len(trace_id) == 32 and len(span_id) == 16 and int(flags, 16) & 1  # sampled
    return trace_id, span_id


def log_records(stack, name: str) -> list[dict]:
    return [json.loads(line) for line in (stack.config.log_dir / f"{name}.log").read_text().splitlines()]


def test_every_hop_is_a_client_span_over_the_callees_server_span(traced_stack):
    stack, receiver = traced_stack
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    response = chat(stack, {"traceparent": f"00-{trace_id}-{client_span_id}-01"}, stream=True)
    request_id = response.headers["x-request-id"]  # none was sent: the gateway's own
    spans = receiver.wait_for(EXPECTED, trace_id)
    by_key = {s.key: s for s in spans}
    assert EXPECTED <= set(by_key), EXPECTED - set(by_key)
    root = by_key[GATEWAY, ROOT, SERVER]
    assert root.parent_id == client_span_id and traceresponse(response) == (trace_id, root.span_id)
    for name in (ENCODE_CHAT, GENERATE):  # the gateway's calls, under its root
        assert by_key[GATEWAY, name, CLIENT].parent_id == root.span_id, name
    for callee, caller in (((TOKENIZER, ENCODE_CHAT), (GATEWAY, ENCODE_CHAT)),
                           ((ROUTER, GENERATE), (GATEWAY, GENERATE)), ((ENGINE, GENERATE), (ROUTER, GENERATE))):
        assert by_key[(*callee, SERVER)].parent_id == by_key[(*caller, CLIENT)].span_id, callee
    assert by_key[ROUTER, GENERATE, CLIENT].parent_id == by_key[ROUTER, GENERATE, SERVER].span_id
    client = by_key[GATEWAY, GENERATE, CLIENT]
    assert client.attributes["rpc.system"] == "grpc" and client.attributes["server.port"] > 0
    assert not any(s.is_error for s in spans)  # the streams the callers cancel after their end included
    assert {s.attributes.get("strata.request_id") for s in spans} == {request_id}
    engine = by_key[ENGINE, GENERATE, SERVER]
    assert engine.events == ["queued", "scheduled", "first_token"]  # the engine's stages, in order
    assert engine.attributes["strata.queue_time_s"] >= 0 and engine.attributes["strata.decode_time_s"] > 0
    assert engine.attributes["strata.engine_request_id"].startswith("chatcmpl-")
    assert root.events[:2] == ["first_token", "first_chunk_sent"]  # the gateway's own stages
    # each process names itself: an engine by its replica id, the router by its id
    assert engine.resource["service.instance.id"] == engine.attributes["strata.replica_id"]
    assert by_key[ROUTER, GENERATE, SERVER].resource["service.instance.id"] == "router-0"
    assert root.resource["service.instance.id"] and root.resource["service.version"] == version()


def test_the_root_has_the_genai_attributes_and_the_request_id_is_everywhere(traced_stack):
    stack, receiver = traced_stack
    request_id = f"client-{secrets.token_hex(4)}"
    response = chat(stack, {"x-request-id": request_id}, stream=False, temperature=0.5, top_p=0.9, seed=7,
                    stop=["never-said"])
    result = response.json()
    assert response.headers["x-request-id"] == request_id
    trace_id, root_span_id = traceresponse(response)
    spans = receiver.wait_for(EXPECTED, trace_id)
    root = next(s for s in spans if s.name == ROOT)
    assert root.span_id == root_span_id and root.parent_id == ""  # no traceparent: the gateway starts the trace
    attributes = root.attributes
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.provider.name"] == "strata"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.response.id"] == result["id"]
    assert attributes["gen_ai.request.max_tokens"] == 5 and attributes["gen_ai.request.seed"] == 7
    assert attributes["gen_ai.request.temperature"] == 0.5 and attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.request.stop_sequences"] == ["never-said"]
    assert attributes["gen_ai.response.finish_reasons"] == [result["choices"][0]["finish_reason"]]
    assert attributes["gen_ai.usage.input_tokens"] == result["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == result["usage"]["completion_tokens"]
    assert {s.service for s in spans} == {GATEWAY, TOKENIZER, ROUTER, ENGINE}
    assert all(s.attributes["strata.request_id"] == request_id for s in spans), \
        [(s.key, s.attributes.get("strata.request_id")) for s in spans]
    # the gateway's access line for it, in JSON, carries its ids
    access = [r for r in log_records(stack, "gateway") if r.get("request_id") == request_id]
    assert access and all(r["trace_id"] == trace_id for r in access), access
    assert any(r["logger"] == "uvicorn.access" and "POST /v1/chat/completions" in r["message"] for r in access)


def test_a_refused_request_marks_the_failing_hop(traced_stack):
    stack, receiver = traced_stack
    trace_id = secrets.token_hex(16)
    chat(stack, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}, stream=False, status=400,
         chat_template="{% for %}")  # the tokenizer cannot compile it: INVALID_ARGUMENT
    keys = {(GATEWAY, ROOT, SERVER), (GATEWAY, ENCODE_CHAT, CLIENT), (TOKENIZER, ENCODE_CHAT, SERVER)}
    spans = {s.key: s for s in receiver.wait_for(keys, trace_id)}
    server = spans[TOKENIZER, ENCODE_CHAT, SERVER]
    assert server.is_error and "exception" in server.events
    assert spans[GATEWAY, ENCODE_CHAT, CLIENT].is_error
    assert spans[GATEWAY, ENCODE_CHAT, CLIENT].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    root = spans[GATEWAY, ROOT, SERVER]
    assert root.attributes["http.response.status_code"] == 400 and not root.is_error


def test_polling_calls_make_no_traces_of_their_own(traced_stack):
    """The router's checks of its engines (Info, Load every second), a caller's Info/Load and /metrics
    scrapes are not traces; an Info inside a caller's trace still is a span of it."""
    stack, receiver = traced_stack
    from services.common.pb import engine_pb2, engine_pb2_grpc

    assert httpx.get(f"{stack.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{stack.base_url}/metrics", timeout=10).status_code == 200
    with grpc.insecure_channel(stack.engine_addr) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for _ in range(5):
            stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)
            stub.Load(engine_pb2.LoadRequest(), timeout=5)
        trace_id = secrets.token_hex(16)
        stub.Info(engine_pb2.EngineInfoRequest(), timeout=5,
                  metadata=(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),))
    spans = receiver.wait_for({(ROUTER, "strata.v1.Engine/Info", SERVER)}, trace_id)
    assert [s.name for s in spans] == ["strata.v1.Engine/Info"]
    time.sleep(1.5)  # part of what is tested: a round of the router's checks, which would be exported as roots
    roots = [s for s in receiver.all_spans() if not s.parent_id and s.name not in (ROOT, STEP)]
    assert not roots, [s.key for s in roots]
    assert not any(s.name.endswith("/health") or s.name == "GET /metrics" for s in receiver.all_spans())


def engine_histogram(url: str, name: str) -> dict[str, float]:
    """An engine's histogram from its /metrics: each bucket's count by ``le``, and ``sum``."""
    text = httpx.get(url, timeout=10).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    values = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    values["sum"] = next(s.value for s in family.samples if s.name.endswith("_sum"))
    return values


def test_queued_requests_show_their_wait_make_no_error_and_their_steps_link_to_them(traced_stack):
    """50 chat requests in bursts of 4 on two engines of one seat each (never past an engine's 1 + 4
    waiting): in a burst, two share an engine and one of them waits for the other's seat. No span of
    any of the 50 traces is an ERROR; a request that arrived while another ran on its engine and was
    scheduled after it shows that wait as its queue time, on its engine span and in the engine's
    strata:request_queue_time_seconds; each step span (--trace-steps) links to the engine span of the
    one request it computed, and a request's steps add up to its prompt, then a decode per token."""
    stack, receiver = traced_stack
    histogram = "strata:request_queue_time_seconds"
    urls = {name: stack.metrics_urls[name] for name in ("engine-0", "engine-1")}
    before = {name: engine_histogram(url, histogram) for name, url in urls.items()}
    max_tokens = 16

    def one(i: int) -> str:
        return traceresponse(chat(stack, {}, stream=i % 2 == 0, max_tokens=max_tokens, ignore_eos=True))[0]

    with futures.ThreadPoolExecutor(4) as pool:
        trace_ids = [trace_id for burst in range(0, 50, 4)
                     for trace_id in pool.map(one, range(burst, min(burst + 4, 50)))]
    engine_spans = {}
    for trace_id in trace_ids:
        spans = receiver.wait_for(EXPECTED, trace_id)
        assert EXPECTED <= {s.key for s in spans}, trace_id
        assert not [s.key for s in spans if s.is_error], trace_id
        (engine,) = [s for s in spans if s.key == (ENGINE, GENERATE, SERVER)]
        engine_spans[engine.span_id] = engine

    # the queue: a request that came while another ran on its replica, and was scheduled after it
    def finished_ns(span) -> float:
        return span.event_times["first_token"] + span.attributes["strata.decode_time_s"] * 1e9

    waits = [(later, earlier) for later in engine_spans.values() for earlier in engine_spans.values()
             if later.attributes["strata.replica_id"] == earlier.attributes["strata.replica_id"]
             and earlier.event_times["scheduled"] < later.event_times["scheduled"]
             and later.event_times["queued"] < finished_ns(earlier) - 5e6]
    assert waits, "no request waited for another's seat"
    for later, earlier in waits:
        assert later.events == ["queued", "scheduled", "first_token"]
        queue_s = later.attributes["strata.queue_time_s"]
        assert (later.event_times["scheduled"] - later.event_times["queued"]) / 1e9 == pytest.approx(queue_s, abs=1e-6)
        waited_s = (finished_ns(earlier) - later.event_times["queued"]) / 1e9
        assert queue_s >= waited_s - 0.005  # it waited until the seat was free
    deadline = time.monotonic() + 30  # an engine counts a request after streaming its last token
    while True:
        after = {name: engine_histogram(url, histogram) for name, url in urls.items()}
        if sum(after[n]["+Inf"] - before[n]["+Inf"] for n in urls) >= 50 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(after[n]["+Inf"] - before[n]["+Inf"] for n in urls) == 50
    assert sum(after[n]["sum"] - before[n]["sum"] for n in urls) == pytest.approx(
        sum(s.attributes["strata.queue_time_s"] for s in engine_spans.values()), abs=1e-6)
    longest = max((later for later, _ in waits), key=lambda s: s.attributes["strata.queue_time_s"])
    replica, waited = longest.attributes["strata.replica_id"], longest.attributes["strata.queue_time_s"]
    below = [le for le in after[replica] if le not in ("+Inf", "sum") and float(le) < waited]

    def counted_from_its_bucket(values: dict[str, float]) -> float:
        return values["+Inf"] - (values[max(below, key=float)] if below else 0)

    assert counted_from_its_bucket(after[replica]) - counted_from_its_bucket(before[replica]) >= 1

    # the steps: each links to the one request it computed (one seat), and they add up. An engine
    # exports a request's step spans before its Generate span (they end first), so they are all in.
    steps = [s for s in receiver.all_spans() if s.name == STEP and any(link[1] in engine_spans for link in s.links)]
    tokens = {span_id: [] for span_id in engine_spans}
    for step in sorted(steps, key=lambda s: s.start_ns):
        (link,) = step.links
        trace_id, span_id, attributes = link
        engine = engine_spans[span_id]
        assert step.parent_id == "" and step.trace_id != trace_id == engine.trace_id and not step.is_error
        assert step.resource["service.instance.id"] == engine.attributes["strata.replica_id"]
        assert step.attributes["strata.step.batch_size"] == 1
        assert attributes["strata.engine_request_id"] == engine.attributes["strata.engine_request_id"]
        assert (step.attributes["strata.step.num_prefill_tokens"] + step.attributes["strata.step.num_decode_tokens"]
                == attributes["strata.step.num_new_tokens"])
        tokens[span_id].append(attributes["strata.step.num_new_tokens"])
    for span_id, engine in engine_spans.items():
        attributes = engine.attributes
        prompt = attributes["gen_ai.usage.input_tokens"] - attributes["strata.cached_prompt_tokens"]
        assert attributes["gen_ai.usage.output_tokens"] == max_tokens
        assert tokens[span_id] == [prompt] + [1] * (max_tokens - 1), attributes["strata.engine_request_id"]


def test_every_service_logs_json_and_the_engines_their_stats_lines(traced_stack):
    stack, _ = traced_stack
    for i in range(3):
        chat(stack, {}, stream=False)
    deadline = time.monotonic() + 30
    while True:
        stats = [r for name in ("engine-0", "engine-1") for r in log_records(stack, name)
                 if r["message"].startswith("Engine engine-")]
        if stats or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats, "no stats line under traffic"
    line = stats[0]["message"]
    for part in ("Avg prompt throughput:", "tokens/s, Avg generation throughput:", "Running:", "Waiting:",
                 "KV cache usage:", "Prefix cache hit rate:"):
        assert part in line, line
    for service in stack.services:
        if service.name != "nats":  # every line of the others parses, with a timestamp and a level
            records = log_records(stack, service.name)
            assert records and all(r["timestamp"] and r["level"] for r in records), service.name


def test_the_stack_stops_without_an_error_or_a_traceback(traced_stack):
    """Last: stops the stack (NATS included) while the router and the engines are connected to it."""
    stack, _ = traced_stack
    chat(stack, {}, stream=True)
    stack.stop()
    for service in stack.services:
        assert service.exit_code is not None, service.name
        text = (stack.config.log_dir / f"{service.name}.log").read_text()
        assert "Traceback" not in text, f"{service.name}:\n{text[-3000:]}"
        if service.name == "nats":
            assert "[ERR]" not in text, text[-3000:]
        else:
            errors = [r for r in log_records(stack, service.name) if r["level"] in ("ERROR", "CRITICAL")]
            assert not errors, f"{service.name}: {errors}"
