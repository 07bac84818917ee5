"""HTTP plumbing around every route, as pure ASGI middleware (they never buffer a stream):
``x-request-id`` on every response, the request's root trace span (and its ``traceresponse``
header), API-key auth on ``/v1``, the request-body size limit, error counting, request durations,
and the boundary that turns any exception into a JSON
answer without dropping the connection.

Each of them looks at a response's start and its last message only (status, headers, its end), so a
stream's chunks in between may go straight to the server past them (`DirectBodyMiddleware`)."""

import hmac
import json
import logging
import time
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common import request_id as request_ids
from services.common import telemetry
from services.gateway import errors

_MAX_REQUEST_ID_LEN = 128
log = logging.getLogger(__name__)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _clean_request_id(raw: bytes | None) -> str | None:
    if not raw:
        return None
    text = raw.decode("latin-1")[:_MAX_REQUEST_ID_LEN]
    return text if text.isprintable() and text.isascii() else None


async def send_error(send: Send, error: errors.OpenAIError) -> None:
    response = error.response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


DIRECT_BODY_SEND = "strata.direct_body_send"  # the scope key of the send past the middleware


class DirectBodyMiddleware:
    """Outermost: puts the send it gets into the scope (``DIRECT_BODY_SEND``), for a streamed response's
    chunks between its start and its last message, which every middleware inside only passes on. A
    token stream's every chunk otherwise went through eight send wrappers (when measured, the gateway's
    CPU per token at 64 streams 0.051 ms against 0.053-0.054). A middleware added inside it must not
    need those chunks."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[DIRECT_BODY_SEND] = send
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Echoes the client's ``x-request-id`` or makes one; handlers read it as
    ``request.state.request_id``, and it is the current request id (`services.common.request_id`)
    while the request is served: on its log lines, its spans, and its gRPC calls' metadata."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = _clean_request_id(_header(scope, b"x-request-id")) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        with request_ids.bound(request_id):
            await self.app(scope, receive, send_with_id)


_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})  # besides /v1/*


class ApiKeyMiddleware:
    """401 on ``/v1/*``, ``/tokenize`` and ``/detokenize`` unless ``Authorization: Bearer <key>`` matches
    (constant-time compare). vLLM leaves its /tokenize open; here it renders chat templates, work that
    only a client with the key may ask for."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in _KEYED_PATHS):
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self._expected):
                return await send_error(send, errors.invalid_api_key())
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 when the body is over ``max_body_bytes``, by Content-Length or while it streams in."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await send_error(send, errors.body_too_large(self.max_body_bytes))
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # FastAPI re-raises an HTTPException from body reading; the app's handler
                    # turns it into an OpenAI error.
                    raise HTTPException(413, errors.body_too_large(self.max_body_bytes).message)
            return message

        await self.app(scope, counting_receive, send)


class ErrorCountMiddleware:
    """Counts responses with status >= 400 by status code and OpenAI error type (read from the
    error body, which is small and whole in its first message; ``unknown`` if it is not one).
    A readiness probe's 503 (``/health`` while an upstream is not serving: every start) is no error
    answered to a client, and is not counted, as vLLM's HTTP metrics leave ``/health`` out."""

    UNCOUNTED_PATHS = frozenset({"/health"})

    def __init__(self, app: ASGIApp, counter) -> None:
        self.app = app
        self._counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.UNCOUNTED_PATHS:
            return await self.app(scope, receive, send)
        error_status: int | None = None

        async def counting_send(message: Message) -> None:
            nonlocal error_status
            if message["type"] == "http.response.start" and message["status"] >= 400:
                error_status = message["status"]
            elif message["type"] == "http.response.body" and error_status is not None:
                self._counter.labels(str(error_status), _error_type(message.get("body", b""))).inc()
                error_status = None
            await send(message)

        await self.app(scope, receive, counting_send)


class HttpMetricsMiddleware:
    """Observes each request's duration, from its arrival to its response's last byte (a stream's
    whole length), in ``histogram`` by method, route and status (``0`` when no response began: the
    client left first). The route is the path template of the route that served the request; for
    one answered before routing (auth, body size, admission), its path when that is one of
    ``paths`` (the app's routes), else ``unmatched``, so the label's values stay few."""

    def __init__(self, app: ASGIApp, histogram, paths: frozenset[str]) -> None:
        self.app = app
        self._histogram = histogram
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrival = time.perf_counter()
        status = 0
        observed = False

        def observe() -> None:
            nonlocal observed
            if not observed:
                observed = True
                self._histogram.labels(scope["method"], self._route(scope), str(status)).observe(
                    time.perf_counter() - arrival)

        async def timing_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                observe()

        try:
            await self.app(scope, receive, timing_send)
        finally:
            observe()

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")  # set by the router (a path that matched with another method too)
        if route is not None and getattr(route, "path", None):
            return route.path
        return scope["path"] if scope["path"] in self._paths else "unmatched"


def _error_type(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["type"])
    except (ValueError, TypeError, KeyError):
        return "unknown"


class ErrorBoundaryMiddleware:
    """The last word on an exception no handler took (a bug): a 500 with an OpenAI body when the
    response has not started, else the response's end, and one log line with the traceback.
    It never re-raises, so the server keeps the client's keep-alive connection; Starlette's own
    last resort re-raises after answering, and uvicorn then closes the connection, which failed the
    client's next request on it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.error("%s %s failed: %s: %s", scope["method"], scope["path"], type(exc).__name__, exc,
                      exc_info=exc)
            if not started:
                await send_error(send, errors.OpenAIError(
                    f"Internal server error: {type(exc).__name__}: {exc}", 500))
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class TracingMiddleware:
    """The root span of each HTTP request (continuing a client's ``traceparent`` when it sends one),
    lasting until the response's last byte, so a stream's span covers the whole stream. gRPC calls
    made while handling the request are its CLIENT spans (``services.common.client_span``); handlers
    add the request's facts (model, usage) to ``trace.get_current_span()``. A recorded span's ids go
    back to the client in a W3C ``traceresponse`` header (``00-<trace id>-<span id>-<flags>``), to
    find the trace by. Probes (``/health``, ``/metrics``) are not traced."""

    UNTRACED_PATHS = frozenset({"/health", "/metrics"})

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.UNTRACED_PATHS:
            return await self.app(scope, receive, send)
        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", ())}
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
        request_id = scope.get("state", {}).get("request_id")
        if request_id:
            attributes[request_ids.SPAN_ATTRIBUTE] = request_id
        with telemetry.server_span(f"{scope['method']} {scope['path']}", carrier, attributes) as span:

            async def send_with_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(telemetry.Status(telemetry.StatusCode.ERROR))
                    if span.is_recording():
                        message = {**message, "headers": [*message.get("headers", []),
                                                          (b"traceresponse", _traceresponse(span))]}
                await send(message)

            await self.app(scope, receive, send_with_status)


def _traceresponse(span) -> bytes:
    """W3C Trace Context Level 2 ``traceresponse``: version, trace id, this server's span id, flags."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}".encode()
