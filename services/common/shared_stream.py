"""A gRPC bidi stream shared by many requests, whose items travel together.

A stream per request costs a gRPC message per request and token on both sides, and grpc.aio's cost
per message (a completion-queue event, a wake-up of the event loop, in the engine a hold of the GIL
that its model thread then waits for) was most of what serving a token cost beyond the model. On a
shared stream, what the requests queue while a write is under way goes out as one message when it is
done: the outputs of one engine step reach the gateway together, so the items they cause leave
together too.

`SharedStream` owns the call, the queue, a writer and a reader task; what an item is, how items make
a message, where a reply goes and what error a broken stream gives its requests are its user's
(``make_message(items)``, ``on_reply(reply)``, ``on_fail(error, unsent_items)``, ``failure(exception)``).
The gateway shares its stream to the engine (or router) this way, and the router its streams to each
engine replica. Each request `join`s it and `leave`s it once; when the last one
leaves, the stream half-closes after sending what is queued, so an idle gateway holds no stream and
a server asked to stop does not wait on one. A stream that fails (the server went away) fails its
requests through ``on_fail``; the next request opens a new one (`SharedStreams`).
"""

import asyncio
from collections.abc import Callable

import grpc
from opentelemetry import trace


class SharedStream:
    """``failure(exception)``: the error the requests get when the call raised ``exception``, or
    (None) when the server ended the stream while requests were still on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall, make_message: Callable[[list], object],
                 on_reply: Callable[[object], None], on_fail: Callable[[Exception, list], None],
                 failure: Callable[[Exception | None], Exception]) -> None:
        self._call = call
        self._make_message, self._on_reply, self._on_fail, self._failure = make_message, on_reply, on_fail, failure
        self._queued: list = []
        self._wake = asyncio.Event()
        self._users = 0
        self.closing = False  # no request joins: the stream half-closes once its queue is sent
        self.error: Exception | None = None
        self._tasks = (asyncio.create_task(self._write_all()), asyncio.create_task(self._read_all()))

    def join(self) -> None:
        self._users += 1

    def leave(self) -> None:
        self._users -= 1
        if self._users == 0:
            self.closing = True
            self._wake.set()

    def send(self, item) -> None:
        """Queues ``item`` for the next message; raises the stream's error once it failed."""
        if self.error is not None:
            raise self.error
        self._queued.append(item)
        self._wake.set()

    def fail(self, error: Exception) -> None:
        """Ends the stream; ``on_fail`` tells its requests."""
        if self.error is not None:
            return
        self.error, self.closing = error, True
        unsent, self._queued = self._queued, []
        self._call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._on_fail(error, unsent)

    async def _write_all(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._queued:
                    items, self._queued = self._queued, []
                    await self._call.write(self._make_message(items))
                    self._wake.set()  # what queued during the write goes next
                elif self.closing:
                    await self._call.done_writing()
                    return
        except Exception as error:
            self.fail(self._failure(error))

    async def _read_all(self) -> None:
        try:
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                self._on_reply(reply)
            if self._users or self._queued:
                self.fail(self._failure(None))
        except Exception as error:
            self.fail(self._failure(error))

class SharedStreams:
    """The current shared stream of one kind (an object whose ``stream`` is its `SharedStream`), a new
    one when there is none or it is closing: ``open_stream()`` makes it."""

    def __init__(self, open_stream: Callable[[], object]) -> None:
        self._open_stream = open_stream
        self.latest = None

    def current(self):
        if self.latest is None or self.latest.stream.closing:
            self.latest = self._open_stream()
        return self.latest

    def close(self, error: Exception) -> None:
        """Fails the current stream's requests with ``error``."""
        if self.latest is not None:
            self.latest.stream.fail(error)


def in_sampled_trace() -> bool:
    """Whether the current request's trace is recorded: such a request keeps gRPC streams of its own,
    whose CLIENT and SERVER spans show its hops, which a stream shared by many requests cannot."""
    return trace.get_current_span().get_span_context().trace_flags.sampled
