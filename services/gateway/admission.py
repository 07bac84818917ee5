"""Admission control: a bound on the generation requests the gateway serves at once
(``--max-concurrent-requests``, TGI's name). Past it a request is refused at once with 503 and
``Retry-After``, before its body is read, so an overload costs the gateway almost nothing and no
client waits unboundedly in a queue it cannot see. A stream counts until its last byte.

The engines bound their own queues too (``--max-waiting-requests``); this bound protects the
gateway process (every admitted request holds sockets, streams and memory here) and, with one
engine, keeps the engine's refusals rare.
"""

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway import errors
from services.gateway.middleware import send_error

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, max_concurrent_requests: int, gauge=None, drain=None) -> None:
        self.app = app
        self._drain = drain  # while it drains (SIGTERM), new generation requests get 503
        self.max_concurrent_requests = max_concurrent_requests
        self.num_in_progress = 0
        self._gauge = gauge  # strata:num_requests_admitted, when given

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self._drain is not None and self._drain.draining:
            return await send_error(send, errors.shutting_down())
        if self.num_in_progress >= self.max_concurrent_requests:
            return await send_error(send, errors.server_overloaded(self.max_concurrent_requests))
        self._set(self.num_in_progress + 1)
        try:
            await self.app(scope, receive, send)
        finally:
            self._set(self.num_in_progress - 1)

    def _set(self, value: int) -> None:
        self.num_in_progress = value
        if self._gauge is not None:
            self._gauge.set(value)
