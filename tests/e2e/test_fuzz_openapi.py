"""Schemathesis against the real stack, from the gateway's own /openapi.json: for each operation,
bodies the schema allows (positive), the same made plausible (our model, n 1, short outputs, so
that most reach the engine), and bodies that break the schema (negative), all over one keep-alive
session. Every answer is below 500 (a 503 would need an overload, which one client cannot make),
every error is an OpenAI error body, no connection is dropped (the requests go through our own
session, not schemathesis', which resends on a dropped connection), and the stack still serves
after, with no 5xx in the gateway's own error count.

Bounded for CI: the stack's context is 128 tokens, 100 examples per operation and kind, derandomized
(the same cases every run); about 25 s of requests and 30 s in all on 2 cores."""

import time
from collections import Counter

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from services.launcher import StackConfig, find_free_port
from tests.e2e.conftest import serving

API_KEY = "sk-fuzz"
MODEL = "strata-tiny-v1"
EXAMPLES = 100  # per operation and kind: positive, plausible, negative
GET_EXAMPLES = 3


@pytest.fixture(scope="module")
def fuzz_stack(default_model_dir, tmp_path_factory):
    config = StackConfig(
        model=str(default_model_dir), port=find_free_port(), served_model_name=MODEL, api_key=API_KEY,
        engine_args=["--max-num-seqs", "8", "--max-model-len", "128", "--num-kv-blocks", "256",
                     "--enforce-eager"],
        gateway_args=["--max-n", "4", "--max-body-bytes", "200000", "--log-level", "warning"],
        log_dir=tmp_path_factory.mktemp("fuzz-logs"), echo_logs=False, startup_timeout_s=120, grace_s=5)
    yield from serving(config)


@pytest.fixture(scope="module")
def session(fuzz_stack):
    with requests.Session() as s:
        s.headers["Authorization"] = f"Bearer {API_KEY}"
        yield s


@pytest.fixture(scope="module")
def api_schema(session, fuzz_stack):
    response = session.get(fuzz_stack.base_url + "/openapi.json", timeout=10)
    assert response.status_code == 200
    return schemathesis.openapi.from_dict(response.json())


def assert_openai_answer(case, response: requests.Response) -> None:
    where = f"{case.method} {case.path} body={case.body!r:.300}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
    if response.status_code >= 400 and case.method.upper() != "HEAD":  # (a HEAD answer has no body)
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert isinstance(error["type"], str) and set(error) == {"message", "type", "param", "code"}, where
        if response.status_code == 401:
            assert response.headers.get("WWW-Authenticate") == "Bearer"
        if response.status_code == 503:
            assert response.headers.get("Retry-After")
    elif response.headers.get("content-type", "").startswith("text/event-stream") and case.path == "/v1/responses":
        last = response.text.rstrip().rsplit("\n\n", 1)[-1]  # OpenAI's Responses events: no [DONE]
        assert last.startswith(("event: response.completed", "event: response.incomplete")), f"{where}: {last[:300]}"
        assert "event: error" not in response.text, f"{where}: {response.text[-300:]}"
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), f"{where}: {response.text[-300:]}"
        assert 'data: {"error"' not in response.text, f"{where}: {response.text[-300:]}"


def plausible(case):
    """A valid body whose fields that gate everything else are made to pass (our model, n 1, a
    short max_tokens, a text prompt, user messages with text), so that the random rest (sampling,
    stop, logprobs, streaming options...) reaches the engine more often."""
    body = case.body
    if not isinstance(body, dict):
        return case
    body["model"] = MODEL
    for name in ("n", "best_of", "response_format"):
        body.pop(name, None)
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if name == "max_tokens" or name in body or (name == "max_output_tokens" and "input" in body):
            value = body.get(name)
            body[name] = 1 + abs(value) % 16 if isinstance(value, int) else 16
    if isinstance(body.get("messages"), list):
        body["messages"] = [{"role": "user", "content": m["content"] if isinstance(m.get("content"), str) and m["content"]
                             else "hi"} for m in body["messages"][:3]] or [{"role": "user", "content": "hi"}]
    if "input" in body and not (isinstance(body["input"], str) and body["input"]):
        body["input"] = "hi"
    if "prompt" in body and not (isinstance(body["prompt"], str) and body["prompt"]) \
            and not isinstance(body.get("messages"), list):  # /tokenize takes one or the other
        body["prompt"] = "hi"
    return case


def fuzz(operation, kind: str, num_examples: int, base_url: str, session) -> Counter:
    statuses: Counter = Counter()
    mode = GenerationMode.NEGATIVE if kind == "negative" else GenerationMode.POSITIVE
    strategy = operation.as_strategy(generation_mode=mode)
    if kind == "plausible":
        strategy = strategy.map(plausible)

    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @given(case=strategy)
    def run(case):
        response = session.request(**case.as_transport_kwargs(base_url=base_url), timeout=60)
        statuses[response.status_code] += 1
        assert_openai_answer(case, response)

    run()
    return statuses


def server_errors(base_url: str, session) -> dict[str, float]:
    """The gateway's own count of the 5xx it answered, by status and error type."""
    metrics = session.get(base_url + "/metrics", timeout=10).text
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("strata:request_errors_total{") and 'status_code="5' in line:
            labels, value = line.rsplit(" ", 1)
            counts[labels] = float(value)
    return counts


def test_fuzz_every_operation_answers_without_server_errors(api_schema, fuzz_stack, session):
    # A /health answered while the stack started may be a 503 (the gateway's channel to an engine
    # that was not listening yet waits out its reconnect backoff): only what the fuzzing adds counts.
    before = server_errors(fuzz_stack.base_url, session)
    started = time.monotonic()
    operations = {op.ok().label: op.ok() for op in api_schema.get_all_operations()}
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= set(operations)
    body_schema = api_schema.raw_schema["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in body_schema["required"]  # the schema describes the request bodies
    calls = {}
    for label, operation in operations.items():
        if operation.method.upper() in ("GET", "HEAD"):  # no body to vary
            calls[label] = fuzz(operation, "positive", GET_EXAMPLES, fuzz_stack.base_url, session)
            continue
        for kind in ("positive", "plausible", "negative"):
            calls[f"{label} {kind}"] = fuzz(operation, kind, EXAMPLES, fuzz_stack.base_url, session)
    elapsed = time.monotonic() - started
    print(f"fuzz: {sum(sum(c.values()) for c in calls.values())} requests in {elapsed:.1f} s: {calls}")
    assert elapsed < 90

    # still serving, and the fuzzing drew no 5xx from the gateway (its own count, not only what we saw)
    response = session.post(fuzz_stack.base_url + "/v1/completions",
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    after = server_errors(fuzz_stack.base_url, session)
    added = {labels: count - before.get(labels, 0.0) for labels, count in after.items()
             if count > before.get(labels, 0.0)}
    assert not added, added
