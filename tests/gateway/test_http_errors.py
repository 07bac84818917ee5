"""The HTTP error contract where no upstream is involved: FastAPI's 422 becomes an OpenAI 400,
auth, body limit, unknown routes, x-request-id, and gRPC status mapping."""

import grpc
import pytest
from fastapi.testclient import TestClient

from services.gateway import errors
from services.gateway.app import GatewayConfig, create_app
from services.gateway.validation import Limits

# Nothing listens on these; the requests below are all refused before an upstream is called.
CONFIG = GatewayConfig(tokenizer_addr="127.0.0.1:9", engine_addr="127.0.0.1:9", api_key="sk-test",
                       limits=Limits(max_body_bytes=2000))
AUTH = {"Authorization": "Bearer sk-test"}


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(CONFIG)) as test_client:
        yield test_client


def assert_openai_error(response, status):
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("body", [
    {"messages": "not a list"},
    {"messages": [{"content": "no role"}]},
    {"prompt": "hi", "messages": [{"role": "user", "content": "x"}], "n": "many"},
    {},
])
def test_validation_errors_are_400_not_422(client, body):
    error = assert_openai_error(client.post("/v1/chat/completions", json=body, headers=AUTH), 400)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_is_400(client):
    response = client.post("/v1/completions", content=b'{"prompt": "hi",',
                           headers={**AUTH, "Content-Type": "application/json"})
    assert "JSON" in assert_openai_error(response, 400)["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}])
def test_missing_or_wrong_api_key_is_401(client, headers):
    response = client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


def test_health_and_metrics_need_no_key(client):
    assert client.get("/metrics").status_code == 200
    assert client.get("/health").status_code == 503  # upstreams down, and it says so


def test_health_and_metrics_answer_head(client):
    """As GET does (uvicorn leaves the body out): a HEAD probe is not refused with 405."""
    metrics = client.head("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert client.head("/health").status_code == 503


def test_body_over_the_limit_is_413(client):
    response = client.post("/v1/completions", json={"prompt": "x" * 5000}, headers=AUTH)
    assert_openai_error(response, 413)


def test_chunked_body_over_the_limit_is_413(client):
    chunks = (b'{"prompt": "' + b"x" * 500 for _ in range(10))
    response = client.post("/v1/completions", content=chunks,
                           headers={**AUTH, "Content-Type": "application/json"})
    assert_openai_error(response, 413)


def test_unknown_route_is_an_openai_404(client):
    assert_openai_error(client.get("/v1/nothing", headers=AUTH), 404)


def test_request_id_is_echoed_or_generated(client):
    echoed = client.post("/v1/completions", json={}, headers={**AUTH, "x-request-id": "abc-123"})
    assert echoed.headers["x-request-id"] == "abc-123"
    generated = client.post("/v1/completions", json={}, headers={"x-request-id": "bad\x01id"})
    assert generated.status_code == 401 and len(generated.headers["x-request-id"]) == 32


def test_errors_are_counted_by_status(client):
    client.get("/v1/nothing", headers=AUTH)
    assert 'strata:request_errors_total{error_type="invalid_request_error",status_code="404"}' in client.get("/metrics").text


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500),
])
def test_grpc_status_mapping(code, status):
    error = errors.from_grpc(FakeRpcError(code, "details here"), "engine")
    assert error.status == status
    assert "details here" in error.message


def test_invalid_argument_keeps_the_upstream_message_verbatim():
    message = "'max_tokens' is too large: 99."
    assert errors.from_grpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, message), "engine").message == message
