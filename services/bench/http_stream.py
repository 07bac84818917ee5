"""One HTTP/1.1 POST whose answer streams as Server-Sent Events, read on a bare asyncio protocol
with httptools' parser (llhttp, as uvicorn's): the benchmark's clients share the machine's cores
with the server they measure, so what they spend per streamed token is taken from it. 64 streams
of 150 events each from a loopback server, one client process, each event timed by `sse.TokenTimeline`:
12.7 us of CPU per event here, 22.0 us through aiohttp's response reader line by line.

So the events are not read while they stream: `post_recorded` keeps the body's pieces as they come,
each with its arrival time (`RecordedEvents`), and `RecordedEvents.replay` reads them afterwards
(when the run is over), every event with the arrival time of the piece that completed it, the time
it had when read as it came. Only the end of the stream is looked for as the pieces come: a
``data: [DONE]`` event that ends a piece ends the answer, as it did when read. The same 64 x 150
events: 2.6 us of CPU per event while they stream, against 7.3 us read and timed as they came
(`sse.TokenTimeline` after `EventSplitter`).

A connection per request (``Connection: close``), as the aiohttp session before it (`client.open_session`);
no proxy; ``https`` with the default certificate checks. A response other than 200 comes back
whole for its error message. An event is what the SSE spec says: lines up to a blank line (LF,
CRLF or CR line ends), the ``data`` fields joined by newlines, comments and other fields ignored.
"""

import asyncio
import contextlib
import functools
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT_S = 10.0


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One context for every https request of the process (making one reads the CA certificates)."""
    return ssl.create_default_context()


class StreamError(Exception):
    """The connection failed, broke, or the answer was not HTTP."""


@dataclass(frozen=True)
class Target:
    """Where a URL points: what the connection and the request line need."""

    host: str
    port: int
    tls: bool
    path: str  # with the query
    host_header: str

    @classmethod
    def of(cls, url: str) -> "Target":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        host = parts.hostname
        bracketed = f"[{host}]" if ":" in host else host
        port = parts.port or (443 if tls else 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(host, port, tls, path, f"{bracketed}:{parts.port}" if parts.port else bracketed)


def request_bytes(target: Target, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"POST {target.path} HTTP/1.1", f"Host: {target.host_header}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class EventSplitter:
    """Bytes of an SSE body in, each event's data out (``None`` for an event without data)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str | None]:
        text = self._pending + chunk if self._pending else chunk
        if b"\r" in text:
            held = text.endswith(b"\r")  # its LF may come in the next chunk
            text = text[:-1] if held else text
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if held else b"")
        blocks = text.split(b"\n\n")
        self._pending = blocks.pop()
        return [_data(block) for block in blocks if block]

    def flush(self) -> list[str | None]:
        """The event left when the body ended without its blank line."""
        rest, self._pending = self._pending.rstrip(b"\r\n"), b""
        return [_data(rest)] if rest else []


def _data(block: bytes) -> str | None:
    if block.startswith(b"data: ") and b"\n" not in block:  # the usual event: one data line
        return block[6:].decode()
    values = []
    for line in block.split(b"\n"):
        name, _, value = line.partition(b":")
        if name == b"data":
            values.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(values).decode() if values else None


# The last event of a piece is [DONE] (its field line, optional space, the blank line that ends it):
# where the stream ends, whatever the server does with the connection after it.
_DONE_AT_END = re.compile(rb"(?:\A|[\r\n])data: ?\[DONE\][ \t]*(?:\r\n|\r|\n)(?:\r\n|\r|\n)\Z")
_DONE_TAIL_BYTES = 24  # what the check above needs of the stream's end


class RecordedEvents:
    """A 200's body, kept as it came: its pieces, each with the `time.perf_counter()` of its arrival."""

    def __init__(self) -> None:
        self._pieces: list[tuple[float, bytes]] = []
        self.ended_at: float | None = None  # when the body ended (or the [DONE] that ends it came)
        self.size = 0  # bytes kept

    def add(self, piece: bytes, now: float) -> None:
        self._pieces.append((now, piece))
        self.size += len(piece)

    def ends_with_done(self) -> bool:
        """Whether the body so far ends with a ``[DONE]`` event (cheap: the pieces' last bytes)."""
        tail = b""
        for _, piece in reversed(self._pieces):
            tail = piece + tail
            if len(tail) > _DONE_TAIL_BYTES:
                break
        return b"[DONE]" in tail and _DONE_AT_END.search(tail) is not None

    def replay(self, on_event: Callable[[str, float], bool]) -> None:
        """Calls ``on_event(data, t)`` for each event's data in order, ``t`` the arrival of the piece
        that completed it, until the events end or ``on_event`` returns False."""
        splitter = EventSplitter()
        for now, piece in self._pieces:
            for data in splitter.feed(piece):
                if data is not None and not on_event(data, now):
                    return
        for data in splitter.flush():  # (the body ended without the event's blank line)
            if data is not None and not on_event(data, self.ended_at):
                return


class _Answer(asyncio.Protocol):
    """Parses one response; a 200's body is kept as it comes (`RecordedEvents`), another status's too,
    whole. ``done`` resolves when the response ended (or its ``[DONE]`` event came)."""

    def __init__(self, done: asyncio.Future) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.events = RecordedEvents()
        self.done = done
        self.status: int | None = None
        self.error_body = bytearray()
        self._framed = False  # a length or chunks, not the connection's end, ends the body
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._end(StreamError("the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._end(StreamError(f"not an HTTP response: {exc}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.done.done():
            return
        if self.status != 200:
            self.error_body += body
            return
        now = time.perf_counter()
        self.events.add(body, now)
        if body.endswith((b"\n", b"\r")) and self.events.ends_with_done():
            self.events.ended_at = now
            self._end(None)

    def on_message_complete(self) -> None:
        if self.status == 200 and not self.done.done():
            self.events.ended_at = time.perf_counter()
        self._end(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self.status is not None and not self._framed:  # the body ended with the connection
            self.on_message_complete()
        self._end(StreamError(f"Server disconnected{f': {exc}' if exc else ''}"))

    def _end(self, error: Exception | None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)


async def post_recorded(url: str | Target, body: bytes, headers: list[tuple[str, str]] = (),
                        timeout_s: float | None = None) -> tuple[int, bytes, RecordedEvents]:
    """POSTs ``body`` (JSON) to ``url`` and keeps a 200's events as they come, up to the body's end or
    its ``[DONE]`` event; read them afterwards with `RecordedEvents.replay`. Returns the status, the
    body of another status, and the events. Raises `StreamError` (connection failed or broke, not
    HTTP) or TimeoutError (past ``timeout_s`` in all)."""
    target = url if isinstance(url, Target) else Target.of(url)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    answer = _Answer(done)
    timeout = asyncio.timeout(timeout_s) if timeout_s else contextlib.nullcontext()
    try:
        async with timeout:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await loop.create_connection(lambda: answer, target.host, target.port,
                                                 ssl=_tls_context() if target.tls else None)
            except OSError as exc:
                raise StreamError(f"cannot connect to {target.host}:{target.port}: {exc}") from None
            answer.transport.write(request_bytes(target, list(headers), body))
            await done
    finally:
        if answer.transport is not None:
            answer.transport.close()
    return answer.status, bytes(answer.error_body), answer.events

