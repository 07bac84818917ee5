"""The gateway's error contract: every failure reaches the client as an OpenAI-shaped error.

Body: ``{"error": {"message", "type", "param", "code"}}``. A request that can never succeed gets a
4xx that the `openai` client does not retry (never 408/409/429/5xx); a server that is down or
overloaded gets 503 with ``Retry-After``, which the client honours when it retries. Once an SSE
stream has started, the same body goes out as one ``data: {"error": ...}`` event followed by
``data: [DONE]`` (see ``sse.py``).

Overload is 503, not 429: in OpenAI's API a 429 is the *caller's* rate or quota limit, and what
refuses here (the gateway's in-flight bound, an engine's full queue) is the server's capacity,
the same for every caller. A gRPC RESOURCE_EXHAUSTED is read the same way, except when it is
gRPC's own message-size limit: that request is too large to ever pass, so it is a 413.
"""

from http import HTTPStatus

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import error_details

RETRY_AFTER_S = 1  # what a 503 asks the client to wait before retrying

# OpenAI's error types by status; the client only reads the status, people read the type.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "client_closed_request",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# Upstream gRPC status -> HTTP status. Anything not listed is a bug somewhere: 500.
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}


class OpenAIError(StarletteHTTPException):
    """An error the client should see as ``status`` with an OpenAI error body. It is an
    ``HTTPException`` so that FastAPI lets it through unchanged from where it reads the body
    (see ``request_body.py``). A 503 carries ``Retry-After``; ``headers`` adds more."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | int | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        if status == 503:
            headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
        message = _encodable(message)
        super().__init__(status, message, headers)
        self.message = message
        self.status = status
        self.param = _encodable(param) if param is not None else None
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "internal_server_error" if status >= 500
                                                   else "invalid_request_error")

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate (echoed client input) escaped, so the body always encodes."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def shutting_down() -> OpenAIError:
    return OpenAIError("The server is shutting down; retry on another instance or later.", 503, code="shutting_down")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist.", 404, param="model",
                       code="model_not_found")


def invalid_api_key() -> OpenAIError:
    return OpenAIError("Incorrect API key provided.", 401, code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def server_overloaded(max_concurrent_requests: int) -> OpenAIError:
    return OpenAIError(f"The server is overloaded: {max_concurrent_requests} requests are already in "
                       "progress (--max-concurrent-requests). Please retry later.", 503,
                       code="server_overloaded")


def client_disconnected() -> OpenAIError:
    """What a request whose client left is logged and counted as (nobody reads it)."""
    return OpenAIError("The client closed the connection before the response.", 499,
                       code="client_disconnected")


def body_too_large(max_body_bytes: int) -> OpenAIError:
    return OpenAIError(f"Request body is larger than the limit of {max_body_bytes} bytes.", 413,
                       code="request_too_large")


def from_grpc(error: grpc.RpcError, upstream: str) -> OpenAIError:
    """Maps an upstream gRPC failure; INVALID_ARGUMENT keeps the upstream's message, parameter and
    code (it is the client's mistake, said by the service that knows the rule), the rest name the
    upstream."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    return from_status(code, details, upstream, lambda: error_details.param_and_code(error))


def from_status(code: grpc.StatusCode, details: str, upstream: str, param_and_code) -> OpenAIError:
    """``param_and_code()``: an INVALID_ARGUMENT's parameter and OpenAI error code (None where unknown)."""
    status = _GRPC_TO_HTTP.get(code, 500)
    if status == 400:
        param, openai_code = param_and_code()
        return OpenAIError(details, 400, param=param, code=openai_code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        # gRPC's message-size limit ("Received message larger than max (N vs. M)"): never retryable
        return OpenAIError(f"The request is too large for the {upstream}: {details}.", 413,
                           code="request_too_large")
    return OpenAIError(f"{upstream} failed: {code.name}: {details}", status, code=code.name.lower())


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 -> an OpenAI 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"Request body is not valid JSON: {first.get('msg', '')}".rstrip(": "))
    param = ".".join(loc) or None
    messages = []
    for error in errors[:3]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        messages.append(f"{where}: {error.get('msg', 'invalid value')}")
    return bad_request("Invalid request: " + "; ".join(messages), param=param)


def install_handlers(app) -> None:
    """Makes FastAPI answer every error, its own included, with an OpenAI body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        # Client errors that are FastAPI's own (unknown route, wrong method) are not retryable.
        return OpenAIError(message, status, headers=exc.headers).response()

    @app.exception_handler(grpc.RpcError)
    async def _grpc_error(_: Request, exc: grpc.RpcError) -> JSONResponse:
        return from_grpc(exc, "upstream").response()

    # Any other exception is a bug: ErrorBoundaryMiddleware answers it with a 500 and keeps the
    # connection. A handler for Exception here would run in Starlette's outermost middleware,
    # which re-raises after answering, and uvicorn then drops the keep-alive connection.
