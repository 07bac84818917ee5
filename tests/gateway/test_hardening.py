"""The gateway's edge under abuse, without upstreams (issue #11): bodies read and refused before
pydantic (lone surrogates, bad UTF-8), strict booleans, ranges the engine's protobuf cannot hold,
the sequences limit, the boundary that answers a bug with a JSON 500 and never re-raises, admission
control, the gRPC status mapping of overload and message size, a client that leaves, and when a
stream's headers go out."""

import asyncio
import time

import grpc
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from services.gateway import errors, serving
from services.gateway.admission import AdmissionMiddleware
from services.gateway.app import MAX_BODY_BYTES_LIMIT, GatewayConfig, create_app
from services.gateway.completions import CompletionRenderer
from services.gateway.generation import Step
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import ErrorBoundaryMiddleware, ErrorCountMiddleware
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.request_body import parse_json_body
from services.gateway.validation import GenerationParams, Limits, ModelFacts, validate_chat, validate_completion
from tests.gateway.test_http_errors import FakeRpcError
from tests.gateway.test_streaming import ScriptedChoices
from tests.waiting import until

CONFIG = GatewayConfig(tokenizer_addr="127.0.0.1:9", engine_addr="127.0.0.1:9", api_key="sk-test")
AUTH = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
FACTS = ModelFacts(name="tiny", max_model_len=100)


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(CONFIG)) as test_client:
        yield test_client


def refusal(call) -> errors.OpenAIError:
    with pytest.raises(errors.OpenAIError) as info:
        call()
    return info.value


# --- the body, before pydantic ---

@pytest.mark.parametrize("raw, param", [
    (rb'{"prompt": "\ud800"}', "prompt"),
    (rb'{"prompt": "ok \uDFFF"}', "prompt"),
    (b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # CESU-8 bytes, which json decodes to a surrogate
    (rb'{"messages": [{"role": "user", "content": "x"}, {"role": "\udc00", "content": "y"}]}', "messages.1.role"),
    (rb'{"chat_template_kwargs": {"a": [1, {"b": "\ud83d"}]}}', "chat_template_kwargs.a.1.b"),
    (rb'{"logit_bias": {"\ud800": 1}}', "logit_bias.\\ud800"),
])
def test_a_lone_surrogate_is_a_400_naming_where(raw, param):
    error = refusal(lambda: parse_json_body(raw))
    assert (error.status, error.param) == (400, param)
    assert "lone UTF-16 surrogate" in error.message
    error.response()  # the message echoes no unencodable text


@pytest.mark.parametrize("raw, parsed", [
    (rb'{"prompt": "\ud83d\ude00"}', {"prompt": "\U0001F600"}),  # a pair is one character
    (rb'{"prompt": "\\ud800"}', {"prompt": "\\ud800"}),  # an escaped backslash, not an escape
    ("{\"prompt\": \"h\u00e9\"}".encode(), {"prompt": "h\u00e9"}),
])
def test_valid_unicode_passes(raw, parsed):
    assert parse_json_body(raw) == parsed


def test_bytes_that_are_not_utf8_are_a_400():
    assert "not valid UTF-8" in refusal(lambda: parse_json_body(b'{"prompt": "\xff"}')).message


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", rb'{"prompt": "\ud800"}', "prompt"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "\udbff"}',
     "cache_salt"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', "stream"),
    ("/v1/completions", b'{"prompt": "hi", "stream": 1}', "stream"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": "true"}', "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),  # past int()'s digits
    ("/v1/completions", b"[" * 50_000, None),  # past the parser's nesting
])
def test_refused_at_the_edge_with_an_openai_400(client, path, raw, param):
    response = client.post(path, content=raw, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_a_long_list_of_token_ids_is_validated_by_its_shape_quickly():
    started = time.perf_counter()
    request = CompletionRequest(prompt=[7] * 2_000_000)
    assert time.perf_counter() - started < 0.5  # a plain union took 1.1 s here (each id failed as a str)
    assert len(request.prompt) == 2_000_000
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[7, "x"])


# --- ranges and limits ---

def test_top_k_past_32_bits_still_means_the_whole_vocabulary():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=2**40)
    params = validate_chat(request, FACTS, Limits())
    assert params.sampling_proto(0).top_k == 2**31 - 1  # the engine's sampler takes min(top_k, vocabulary)


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("repetition_penalty", 3.5e38),
                                          ("presence_penalty", -1e300), ("min_p", float("inf"))])
def test_floats_past_float32_are_a_400(field, value):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{field: value})
    error = refusal(lambda: validate_chat(request, FACTS, Limits()))
    assert (error.status, error.param) == (400, field)


def test_sequences_per_request_are_n_times_prompts():
    limits = Limits(max_n=8, max_prompts=8, max_sequences_per_request=12)
    assert validate_completion(CompletionRequest(prompt=["a", "b", "c"], n=4), FACTS, limits).n == 4
    error = refusal(lambda: validate_completion(CompletionRequest(prompt=["a", "b", "c"], n=5), FACTS, limits))
    assert (error.status, error.param) == (400, "n")
    assert "15 sequences (n=5 x 3 prompts)" in error.message and "--max-sequences-per-request" in error.message


def test_limits_that_cannot_agree_refuse_to_start():
    with pytest.raises(ValueError, match="--max-body-bytes"):
        GatewayConfig(tokenizer_addr="a:1", engine_addr="a:1", limits=Limits(max_body_bytes=MAX_BODY_BYTES_LIMIT + 1))
    with pytest.raises(ValueError, match="--max-concurrent-requests"):
        GatewayConfig(tokenizer_addr="a:1", engine_addr="a:1", max_concurrent_requests=0)
    with pytest.raises(ValueError, match="--max-sequences-per-request"):
        GatewayConfig(tokenizer_addr="a:1", engine_addr="a:1", limits=Limits(max_sequences_per_request=0))


# --- status mapping ---

def test_overload_is_503_with_retry_after_and_message_size_is_413():
    full = errors.from_grpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the engine is at capacity"), "engine")
    assert full.status == 503 and full.headers["Retry-After"] == "1"
    assert full.response().headers["retry-after"] == "1"
    too_big = errors.from_grpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            "Received message larger than max (70000000 vs. 67108864)"), "tokenizer")
    assert (too_big.status, too_big.code) == (413, "request_too_large")
    assert errors.from_grpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down"), "engine").headers["Retry-After"] == "1"


def test_401_carries_www_authenticate(client):
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"


# --- the boundary: a bug is a JSON 500, counted, never re-raised ---

def boundary_app() -> tuple[FastAPI, GatewayMetrics]:
    metrics = GatewayMetrics()
    app = FastAPI()
    errors.install_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("bug")

    @app.get("/boom-mid-stream")
    async def boom_mid_stream():
        async def body():
            yield b"data: partial\n\n"
            raise RuntimeError("bug mid-stream")
        return StreamingResponse(body(), media_type="text/event-stream")

    app.add_middleware(ErrorBoundaryMiddleware)
    app.add_middleware(ErrorCountMiddleware, counter=metrics.request_errors)
    return app, metrics


def test_a_bug_is_a_json_500_that_is_counted_and_not_reraised():
    app, metrics = boundary_app()
    with TestClient(app, raise_server_exceptions=True) as test_client:  # a re-raise would fail here
        response = test_client.get("/boom")
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "internal_server_error"
        assert "RuntimeError: bug" in response.json()["error"]["message"]
        streamed = test_client.get("/boom-mid-stream")
        assert streamed.status_code == 200 and streamed.text == "data: partial\n\n"  # ended, not cut
    count = metrics.registry.get_sample_value(
        "strata:request_errors_total", {"status_code": "500", "error_type": "internal_server_error"})
    assert count == 1


# --- admission ---

def test_admission_refuses_past_the_bound_at_once_and_frees_slots():
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    metrics = GatewayMetrics()
    admission = AdmissionMiddleware(slow_app, max_concurrent_requests=2, gauge=metrics.num_requests_admitted)

    async def call(path: str = "/v1/completions") -> list[dict]:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await admission({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)
        return sent

    async def scenario():
        first, second = asyncio.create_task(call()), asyncio.create_task(call())
        await until(lambda: admission.num_in_progress == 2, what="both calls admitted")
        assert admission.num_in_progress == 2 and metrics.num_requests_admitted._value.get() == 2
        refused = await asyncio.wait_for(call(), 1.0)  # answered at once, while the two still run
        other_path = asyncio.create_task(call("/v1/models"))  # only generation routes are bounded
        release.set()
        await asyncio.gather(first, second, other_path)
        assert admission.num_in_progress == 0
        return refused, await call()

    refused, later = asyncio.run(scenario())
    start, body = refused
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert b'"code":"server_overloaded"' in body["body"]
    assert later[0]["status"] == 200


# --- the request driver: a client that leaves, a stream's headers ---

class FakeRequest:
    """What serve() uses of a Request: receive() (here: a disconnect after ``leave_after_s``)."""

    def __init__(self, leave_after_s: float | None = None) -> None:
        self._leave_after_s = leave_after_s

    async def receive(self):
        if self._leave_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self._leave_after_s)
        return {"type": "http.disconnect"}


def run_serve(monkeypatch, items, stream: bool, leave_after_s: float | None = None, headers_timeout_s: float = 0.1):
    """serve() with its choices scripted ((delay_s, step or exception) items); the response, how long
    it took to answer, the streamed body and the scripted choices."""
    made = []

    def fanout(upstream, specs, params, eos_token_ids, sink, span):
        made.append(ScriptedChoices(items, sink))
        return made[-1]

    monkeypatch.setattr(serving, "FanOut", fanout)
    metrics = GatewayMetrics()
    state = serving.GatewayState(None, metrics, Limits(), stream_headers_timeout_s=headers_timeout_s)
    params = GenerationParams(stream=stream, max_tokens=4)

    async def scenario():
        started = time.monotonic()
        response = await serving.serve(FakeRequest(leave_after_s), state, FACTS,
                                       serving.RequestContext.new("cmpl", "tiny"), params, [[1, 2, 3]],
                                       CompletionRenderer(None, False, None, 1))
        answered_s = time.monotonic() - started
        body = []
        if isinstance(response, serving._ChoiceStream):
            async def send(message):
                body.append(message.get("body", b""))

            await asyncio.wait_for(response({"type": "http"}, FakeRequest().receive, send), 5)
        return response, answered_s, b"".join(body)

    response, answered_s, body = asyncio.run(scenario())
    made[0].metrics = metrics
    return response, answered_s, body, made[0]


def test_a_queued_stream_gets_its_headers_before_its_first_token(monkeypatch):
    steps = [(1.0, Step(0, "late", [5], finish_reason="length", completion_tokens=1))]
    response, answered_s, body, _ = run_serve(monkeypatch, steps, stream=True)
    assert response.status_code == 200 and answered_s < 0.5  # the headers, after 0.1 s, not after 1 s
    assert b'"text":"late"' in body and body.endswith(b"data: [DONE]\n\n")


def test_an_early_refusal_is_still_an_http_status(monkeypatch):
    items = [(0.01, errors.OpenAIError("engine failed: RESOURCE_EXHAUSTED: full", 503))]
    with pytest.raises(errors.OpenAIError) as info:
        run_serve(monkeypatch, items, stream=True)
    assert info.value.status == 503


def test_a_refusal_after_the_headers_is_an_error_event_counted_in_metrics(monkeypatch):
    items = [(0.3, errors.OpenAIError("engine failed: RESOURCE_EXHAUSTED: full", 503))]
    response, _, body, fanout = run_serve(monkeypatch, items, stream=True)
    assert response.status_code == 200
    assert b'"type":"service_unavailable_error"' in body and body.endswith(b"data: [DONE]\n\n")
    assert fanout.metrics.registry.get_sample_value(
        "strata:request_errors_total", {"status_code": "503", "error_type": "service_unavailable_error"}) == 1


def test_a_client_that_leaves_a_non_streamed_request_is_499_and_cancels(monkeypatch, caplog):
    steps = [(5.0, Step(0, "never", [5], finish_reason="length", completion_tokens=1))]
    with caplog.at_level("INFO", logger="services.gateway.serving"):
        response, answered_s, _, fanout = run_serve(monkeypatch, steps, stream=False, leave_after_s=0.05)
    assert response.status_code == 499 and answered_s < 1.0
    assert fanout.cancelled
    assert [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()]
    assert not [r for r in caplog.records if r.exc_info]
