"""One streamed request to an OpenAI-compatible server, timed on the client."""

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.bench.datasets import BenchRequest
from services.bench.http_stream import RecordedEvents, StreamError, post_recorded
from services.bench.sse import TokenTimeline
from services.bench.stats import RequestOutput

MAX_REASON_CHARS = 160


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    url: str  # the full endpoint URL
    model: str
    chat: bool
    ignore_eos: bool = False
    temperature: float | None = None
    continuous_usage_stats: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def open_session(request_timeout_s: float | None, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """The benchmark's HTTP session: its headers and total timeout hold for every request; it makes
    the run's unstreamed calls (models, metrics), and `send_request` streams with its settings on
    `http_stream`, which costs the client a third of aiohttp's CPU per streamed token (and aiohttp a
    third of httpx's): client and server share the machine's cores. No connection limit, no proxy
    from the environment.

    Each request gets a connection of its own, closed after it (as vLLM's benchmark, which opens a
    session per request): a server may close a kept-alive connection at any moment (llama-server's
    HTTP library after a few requests), and a request sent on it just then fails with "Server
    disconnected", 22 of 256 requests to llama-server at 64 streams. A connection on loopback costs
    well under a millisecond, once per request."""
    return aiohttp.ClientSession(headers=headers or {}, connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10.0))


def build_payload(settings: RequestSettings, request: BenchRequest) -> dict[str, Any]:
    stream_options: dict[str, bool] = {"include_usage": True}
    if settings.continuous_usage_stats:
        stream_options["continuous_usage_stats"] = True
    payload: dict[str, Any] = {"model": settings.model, "max_tokens": request.output_len,
                               "stream": True, "stream_options": stream_options}
    if settings.chat:
        payload["messages"] = request.messages
    else:
        payload["prompt"] = request.prompt
    if settings.ignore_eos:
        payload["ignore_eos"] = True
    if settings.temperature is not None:
        payload["temperature"] = settings.temperature
    payload.update(settings.extra_body)
    return payload


def short_reason(reason: str) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."


def _error_message(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = body.decode(errors="replace")
    return short_reason(f"HTTP {status}: {message or ''}")


async def send_request(session: aiohttp.ClientSession, settings: RequestSettings,
                       request: BenchRequest) -> RequestOutput:
    """Stream one request; never raises for a failed request (the reason is in `error`). The stream is
    read by `http_stream` with ``session``'s headers and total timeout (the session itself serves the
    run's other, unstreamed calls). Its events are kept as they came, unread: `settle` reads them (the
    token timings, or the error the stream ended with) once the run is over."""
    body = json.dumps(build_payload(settings, request)).encode()
    out = RequestOutput(prompt_tokens=request.prompt_len)
    start = time.perf_counter()
    try:
        status, error_body, events = await post_recorded(settings.url, body, list(session.headers.items()),
                                                         session.timeout.total)
    except (StreamError, asyncio.TimeoutError) as exc:
        out.error = short_reason(f"{type(exc).__name__}: {exc}")
        return out
    if status != 200:
        out.error = _error_message(status, error_body)
        return out
    out.latency = time.perf_counter() - start
    out.unread = _Unread(start, events)
    return out


@dataclass
class _Unread:
    """A request's stream as it came: when the request was sent, and its events."""
    start: float
    events: RecordedEvents


def settle(out: RequestOutput) -> None:
    """Reads the events `send_request` kept of a request (none for one that failed before it streamed, or
    was read already): its TTFT, inter-token gaps and token counts, or the error its stream ended with."""
    unread, out.unread = out.unread, None
    if unread is None:
        return
    timeline = TokenTimeline(start=unread.start)
    unread.events.replay(timeline.on_data)
    if timeline.error is not None:
        out.error = short_reason(f"stream error: {timeline.error}")
        return
    if timeline.ttft is None:
        out.error = "no tokens in the stream"
        return
    out.success = True
    out.ttft = timeline.ttft
    out.itl = timeline.itl
    out.output_tokens = timeline.output_tokens
    if timeline.prompt_tokens is not None:
        out.prompt_tokens = timeline.prompt_tokens
    out.cached_tokens = timeline.cached_tokens
