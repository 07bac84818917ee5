"""The server's side of GenerateMany: many requests over one gRPC stream (the engine's and the router's).

A Generate stream per request costs a gRPC message per request and token, and grpc.aio's cost per
message ran on the gRPC thread holding the GIL, which the engine's model thread then waited for: at
64 streams that slowed every decode step by about a fifth (the engine loop now shares the gRPC
server's thread, `AsyncEngine.drive`; one message per step still costs far less than one per
request). Here ``start_one(request, replies)`` starts each request as its server's Generate would,
and its outputs go to its `Replies`, which put them in the stream's outbox; one sender sends
everything in the outbox as one message. The engine submits each request to its engine loop, whose
one callback per step passes every request's outputs on (no task per request: at 64 streams the
tasks' wake-ups were most of the gRPC loop's Python work); the router relays each request in a task
of its own (`in_tasks`).

A request that fails gets an error entry with the status its own Generate stream would have ended
with (`grpc_server.status_for`, or a relayed call's own status with its parameter); the stream and
its other requests go on. When the caller closes its side, the stream ends once its running requests
have; when it cancels, they are aborted.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeVar

import grpc

from services.common import error_details
from services.common.errors import InvalidRequestError
from services.common.grpc_server import status_for
from services.common.pb import engine_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

RunOne = Callable[[engine_pb2.GenerateRequest], AsyncIterator[engine_pb2.GenerateResponse]]
# How one entry of a GenerateManyResponse gets its result: fill(entry, value), as the message is built;
# None: the value is the entry's next_token.
Fill = Callable[[engine_pb2.GenerateManyOutput, object], None] | None


class Replies:
    """Where one request's outputs go on its GenerateMany stream: ``output(response)`` for each, then
    ``end()`` after the one with a finish reason, or ``fail(exception)`` (the status its own Generate
    stream would have ended with) instead. ``output_with(fill, value)`` passes an output on as
    ``fill(response, value)``, which writes it into the message's empty GenerateResponse when the
    message is built: the engine's outputs go in field by field, with no message of their own to copy."""

    def __init__(self, request_id: str, emit: Callable[[str, Fill, object], None],
                 ended: Callable[["Replies"], None], next_token_entries: bool = False) -> None:
        self.request_id, self._emit, self._ended = request_id, emit, ended
        self.next_token_entries = next_token_entries  # the caller reads them (GenerateManyRequest's flag)
        self._last: engine_pb2.GenerateResponse | None = None  # the last output(), as `next_token` compares

    def output(self, response: engine_pb2.GenerateResponse) -> None:
        """As `next_token` where the caller reads them and it is one token and nothing else but a usage
        one completion token past the previous output's, from the same replica (the router's relay of
        the engine's)."""
        if self.next_token_entries and _follows_as_next_token(response, self._last):
            self.next_token(response.token_ids[0])
        else:
            self._emit(self.request_id, _copy_output, response)
        self._last = response

    def output_with(self, fill: Callable[[engine_pb2.GenerateResponse, T], None], value: T) -> None:
        self._emit(self.request_id, _fill_output, (fill, value))

    def next_token(self, token_id: int) -> None:
        """An output of this one token and nothing else but usage, one completion token more than the
        previous output's (``GenerateManyOutput.next_token``: 0.33 us to write against an output's 1.53);
        only where ``next_token_entries``."""
        self._emit(self.request_id, None, token_id)

    def fail(self, exc: Exception) -> None:
        self._emit(self.request_id, _set_error, request_error(exc))
        self.end()

    def end(self) -> None:
        self._ended(self)


def _follows_as_next_token(response: engine_pb2.GenerateResponse, last: engine_pb2.GenerateResponse | None) -> bool:
    """The engine's rule (`services.engine.protocol.follows_as_next_token`) on the protobuf, the same
    replica too (a migrated request's first output from another one goes in full)."""
    if last is None or len(response.token_ids) != 1 or response.finish_reason or response.logprobs \
            or response.prompt_logprobs or response.HasField("stop_token_id") or response.replica_id != last.replica_id:
        return False
    usage, last_usage = response.usage, last.usage
    return (usage.completion_tokens == last_usage.completion_tokens + 1 and usage.prompt_tokens == last_usage.prompt_tokens
            and usage.cached_prompt_tokens == last_usage.cached_prompt_tokens)


def _copy_output(entry: engine_pb2.GenerateManyOutput, response: engine_pb2.GenerateResponse) -> None:
    entry.output.CopyFrom(response)


def _set_error(entry: engine_pb2.GenerateManyOutput, error: engine_pb2.RequestError) -> None:
    entry.error.CopyFrom(error)


def _fill_output(entry: engine_pb2.GenerateManyOutput, fill_and_value: tuple[Callable, object]) -> None:
    fill, value = fill_and_value
    output = entry.output
    output.SetInParent()  # an output even where ``fill`` writes no field
    fill(output, value)


class Started(Protocol):
    def cancel(self) -> None:
        """Aborts the request; nothing more reaches its `Replies`."""


StartOne = Callable[[engine_pb2.GenerateRequest, Replies], Started]


def in_tasks(run_one: RunOne) -> StartOne:
    """Starts each request as a task that reads ``run_one(request)`` (its outputs, or the exception its
    Generate call would end with) into its `Replies` (the router's relay)."""

    def start(request: engine_pb2.GenerateRequest, replies: Replies) -> asyncio.Task:
        async def run() -> None:
            try:
                async with contextlib.aclosing(run_one(request)) as outputs:  # aborted at once when cancelled
                    async for output in outputs:
                        replies.output(output)
            except Exception as exc:
                replies.fail(exc)
            else:
                replies.end()

        return asyncio.create_task(run())

    return start


def request_error(exc: Exception) -> engine_pb2.RequestError:
    """What a request's own Generate stream would have ended with for ``exc``."""
    if isinstance(exc, grpc.aio.AioRpcError):  # a relayed call's status (the router), passed on as it is
        param, error_code = error_details.param_and_code(exc)
        return engine_pb2.RequestError(code=exc.code().value[0], message=exc.details() or "", param=param or "",
                                       error_code=error_code or "")
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("GenerateMany request failed", exc_info=exc)
    error = engine_pb2.RequestError(code=code.value[0], message=message)
    if isinstance(exc, InvalidRequestError):
        error.param, error.error_code = exc.param or "", exc.code or ""
    return error


async def serve_generate_many(start_one: StartOne, request_iterator) -> AsyncIterator[engine_pb2.GenerateManyResponse]:
    """The GenerateMany stream over ``request_iterator``, each request started by ``start_one``."""
    outbox: list[tuple[str, Fill, object]] = []  # (request id, fill, value): each a message entry
    wake = asyncio.Event()
    running: dict[str, tuple[Replies, Started]] = {}

    def emit(request_id: str, fill: Fill, value) -> None:
        outbox.append((request_id, fill, value))
        wake.set()

    def ended(replies: Replies) -> None:
        entry = running.get(replies.request_id)
        if entry is not None and entry[0] is replies:  # not a later request of the same id
            del running[replies.request_id]
        wake.set()

    def start(request: engine_pb2.GenerateRequest, next_token_entries: bool) -> None:
        request_id = request.request_id
        replies = Replies(request_id, emit, ended, next_token_entries)
        if not request_id or request_id in running:
            problem = "is required" if not request_id else f"{request_id!r} is already running"
            replies.fail(InvalidRequestError(f"GenerateMany: request_id {problem}", param="request_id"))
            return
        try:
            running[request_id] = (replies, start_one(request, replies))
        except Exception as exc:
            replies.fail(exc)

    async def read_requests() -> None:
        async for message in request_iterator:
            for request_id in message.abort_request_ids:
                entry = running.pop(request_id, None)
                if entry is not None:
                    entry[1].cancel()  # the engine aborts the request (frees its blocks)
            for request in message.requests:
                start(request, message.next_token_entries)

    reader = asyncio.create_task(read_requests())
    reader.add_done_callback(lambda _: wake.set())
    try:
        while True:  # the state is checked before each wait: a request may end while its outputs are sent
            if outbox:
                message = engine_pb2.GenerateManyResponse()
                add = message.outputs.add
                for request_id, fill, value in outbox:
                    if fill is None:
                        add(request_id=request_id, next_token=value)
                    else:
                        fill(add(request_id=request_id), value)
                outbox.clear()
                yield message
            elif reader.done() and (not running or reader.exception() is not None):
                reader.result()  # the caller's side failed: so does the stream
                return
            else:
                await wake.wait()
                wake.clear()
    finally:
        reader.cancel()
        for _, started in running.values():
            started.cancel()
