"""The gateway's /metrics carries what the gateway measures itself (issue #12, item 3): its own
in-flight gauge under a gateway name, each HTTP request's duration by method, route template and
status (a stream's until its last byte), and none of the engines' series, which each engine serves
on its own /metrics. No upstreams: the app answers these without them."""

import asyncio

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from services.gateway.app import GatewayConfig, create_app
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import DirectBodyMiddleware, HttpMetricsMiddleware
from services.gateway.serving import _ChoiceStream
from tests.gateway.test_stream_writes import TextEvents, event_stream, push_steps

CONFIG = GatewayConfig(tokenizer_addr="127.0.0.1:9", engine_addr="127.0.0.1:9", api_key="sk-test")
ENGINE_SERIES = ("strata:num_requests_running", "strata:num_requests_waiting", "strata:engine_num_requests_running",
                 "strata:kv_cache_usage_perc", "strata:prefix_cache_queries", "strata:prefix_cache_hits",
                 "strata:num_preemptions")


def durations(text: str) -> dict[tuple[str, str, str], float]:
    """(method, route, status) -> observations, from the histogram's _count lines."""
    counts = {}
    for line in text.splitlines():
        if line.startswith("strata:http_request_duration_seconds_count{"):
            labels = dict(pair.split("=") for pair in line[line.index("{") + 1:line.index("}")].split(","))
            key = tuple(labels[name].strip('"') for name in ("method", "route", "status"))
            counts[key] = float(line.rsplit(" ", 1)[1])
    return counts


def test_the_gateway_exports_its_own_measures_and_no_engine_series():
    with TestClient(create_app(CONFIG)) as client:
        assert client.post("/v1/chat/completions", json={}).status_code == 401  # refused before routing
        assert client.get("/v1/models/x").status_code == 401
        assert client.get("/no/such/path").status_code == 404
        assert client.put("/metrics").status_code == 405
        client.get("/metrics")
        text = client.get("/metrics").text
    assert durations(text) == {("POST", "/v1/chat/completions", "401"): 1, ("GET", "unmatched", "401"): 1,
                               ("GET", "unmatched", "404"): 1, ("PUT", "/metrics", "405"): 1,
                               ("GET", "/metrics", "200"): 1}
    assert "# TYPE strata:gateway_num_requests_running gauge" in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("strata:")}
    for series in ENGINE_SERIES:
        assert not {name for name in names if name == series or name.startswith(series + "_")}, series



def test_the_served_names_series_are_there_at_zero_before_the_first_request():
    """As vLLM makes its series at start (request_success for every finish reason): a counter that
    appears at its first increment hides that increment from rate() and increase() (Prometheus sees
    no 0 before it), and a query for a model or reason not seen yet answers nothing instead of 0."""
    config = GatewayConfig(tokenizer_addr="127.0.0.1:9", engine_addr="127.0.0.1:9", served_model_name="m",
                           served_model_aliases=("alias",))
    with TestClient(create_app(config)) as client:
        text = client.get("/metrics").text
    for model in ("m", "alias"):
        for series in ("strata:prompt_tokens_total", "strata:generation_tokens_total",
                       "strata:gateway_num_requests_running", "strata:time_to_first_token_seconds_count",
                       "strata:e2e_request_latency_seconds_count",
                       "strata:request_time_per_output_token_seconds_count"):
            assert f'{series}{{model_name="{model}"}} 0.0' in text, (series, model)
        for reason in ("stop", "length"):
            assert f'strata:request_success_total{{finished_reason="{reason}",model_name="{model}"}} 0.0' in text


def test_a_readiness_probes_503_is_no_error_answered():
    """/health's 503 (an upstream not serving yet: every start, while the engine loads) tells a probe
    to wait, as vLLM's /health does, whose HTTP metrics leave /health out: it is no error answered to a
    client, and an alert on strata:request_errors_total{status_code=~"5.."} fired at every start."""
    with TestClient(create_app(CONFIG)) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/v1/models").status_code == 401
        text = client.get("/metrics").text
    errors = [line for line in text.splitlines() if line.startswith("strata:request_errors_total{")]
    assert errors == ['strata:request_errors_total{error_type="invalid_request_error",status_code="401"} 1.0']

def test_a_streams_duration_runs_to_its_last_byte():
    metrics = GatewayMetrics()
    app = FastAPI()

    @app.get("/stream/{name}")
    async def stream(name: str):
        async def body():
            for _ in range(3):
                await asyncio.sleep(0.1)  # the stream's pace: its duration is what is measured
                yield b"data: x\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    app.add_middleware(HttpMetricsMiddleware, histogram=metrics.http_request_duration, paths=frozenset())
    with TestClient(app) as client:
        assert client.get("/stream/a").text == "data: x\n\n" * 3
    labels = {"method": "GET", "route": "/stream/{name}", "status": "200"}
    assert metrics.registry.get_sample_value("strata:http_request_duration_seconds_count", labels) == 1
    assert metrics.registry.get_sample_value("strata:http_request_duration_seconds_sum", labels) >= 0.3


def test_a_streams_events_go_past_the_middleware_which_still_see_its_start_and_end():
    """`DirectBodyMiddleware`: the gateway's SSE response sends its start and its last message through
    the middleware inside, its events in between straight to the server; the client gets every event,
    and the duration still runs to the last byte."""
    metrics = GatewayMetrics()
    app = FastAPI()
    seen = []
    closed = []
    pushing = []  # (a task's reference kept)

    @app.get("/stream")
    async def stream():
        events = event_stream(TextEvents())
        pushing.append(asyncio.create_task(push_steps(events, ["0", "1", "2"], 0.1)))
        return _ChoiceStream(events, lambda: closed.append(True))

    class Recording:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)

            async def recording_send(message):
                seen.append((message["type"], message.get("more_body", False)))
                await send(message)
            await self.app(scope, receive, recording_send)

    app.add_middleware(Recording)
    app.add_middleware(HttpMetricsMiddleware, histogram=metrics.http_request_duration, paths=frozenset())
    app.add_middleware(DirectBodyMiddleware)
    with TestClient(app) as client:
        response = client.get("/stream")
    assert response.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert seen == [("http.response.start", False), ("http.response.body", False)]
    assert closed == [True]
    labels = {"method": "GET", "route": "/stream", "status": "200"}
    assert metrics.registry.get_sample_value("strata:http_request_duration_seconds_sum", labels) >= 0.3
