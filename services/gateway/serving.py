"""The request driver shared by chat and completions: plan the choices, run them, and answer as
one JSON response or as an SSE stream, with usage, metrics and client-disconnect handling.

What differs between the two endpoints (chunk and response shapes, logprobs) is a ``Renderer``.
Errors before the first generated token become a plain HTTP error (so an upstream that is down is a
503 the client may retry); after that, an SSE error event and ``[DONE]``.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace

from services.gateway import sse
from services.gateway.errors import OpenAIError
from services.gateway.generation import FanOut, Step, plan_choices
from services.gateway.metrics import GatewayMetrics
from services.gateway.upstream import Upstream
from services.gateway.validation import GenerationParams, Limits, ModelFacts, resolve_max_tokens


@dataclass
class GatewayState:
    """What every route needs; lives on ``app.state.gateway``."""
    upstream: Upstream
    metrics: GatewayMetrics
    limits: Limits
    tool_call_parser: str | None = None  # set when auto tool choice is on


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


@dataclass
class RequestContext:
    response_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)

    @classmethod
    def new(cls, prefix: str, model: str) -> "RequestContext":
        return cls(f"{prefix}-{uuid.uuid4().hex}", model)


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response, accumulated from its steps."""
    index: int
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Renderer(Protocol):
    chunk_object: str
    response_object: str

    def preamble(self, indices: list[int]) -> list[dict]:
        """Choice entries streamed before any token (chat: the role; completions: echo)."""

    async def stream_choice(self, step: Step) -> dict | None:
        """The choice entry of one step's chunk, or None when there is nothing to send."""

    async def full_choice(self, result: ChoiceResult) -> dict:
        """One choice of the non-streamed response."""


class Usage:
    """Token counts over all choices: each prompt counted once, cached tokens as the least any of
    its choices found in the prefix cache."""

    def __init__(self, prompts: list[list[int]], n: int) -> None:
        self._n = n
        self._prompt_tokens = [len(p) for p in prompts]
        self._completion = [0] * (len(prompts) * n)
        self._cached: list[int | None] = [None] * (len(prompts) * n)

    def update(self, step: Step) -> None:
        self._completion[step.index] = step.completion_tokens
        self._cached[step.index] = step.cached_tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(self._completion)

    def as_dict(self) -> dict:
        cached = 0
        for prompt_index in range(len(self._prompt_tokens)):
            seen = [c for c in self._cached[prompt_index * self._n:(prompt_index + 1) * self._n]
                    if c is not None]
            cached += min(seen) if seen else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


class _ClientDisconnected(Exception):
    pass


async def _cancel_on_disconnect(request: Request, work: Awaitable):
    """Awaits ``work``; if the client disconnects first, cancels it (aborting the upstream calls)."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise _ClientDisconnected()
    return task.result()


class _Recorder:
    """Metrics of one request."""

    def __init__(self, metrics: GatewayMetrics, ctx: RequestContext) -> None:
        self._metrics = metrics
        self._ctx = ctx
        self._first_token_at: float | None = None
        metrics.num_requests_running.labels(ctx.model).inc()

    def step(self, step: Step) -> None:
        if self._first_token_at is None and step.token_ids:
            self._first_token_at = time.monotonic()
            self._metrics.time_to_first_token.labels(self._ctx.model).observe(
                self._first_token_at - self._ctx.arrival)
        if step.finish_reason is not None:
            self._metrics.request_success.labels(self._ctx.model, step.finish_reason).inc()

    def done(self, usage: Usage, completed: bool) -> None:
        model = self._ctx.model
        self._metrics.num_requests_running.labels(model).dec()
        if not completed:
            return
        now = time.monotonic()
        self._metrics.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        self._metrics.generation_tokens.labels(model).inc(usage.completion_tokens)
        self._metrics.e2e_latency.labels(model).observe(now - self._ctx.arrival)
        if self._first_token_at is not None and usage.completion_tokens > 1:
            self._metrics.time_per_output_token.labels(model).observe(
                (now - self._first_token_at) / (usage.completion_tokens - 1))


async def serve(request: Request, upstream: Upstream, metrics: GatewayMetrics, facts: ModelFacts,
                ctx: RequestContext, params: GenerationParams, prompts: list[list[int]],
                renderer: Renderer) -> Response:
    max_tokens = [resolve_max_tokens(params, len(prompt), facts) for prompt in prompts]
    specs = plan_choices(ctx.response_id, prompts, max_tokens, params)
    fanout = FanOut(upstream, specs, params, facts.eos_token_ids)
    usage = Usage(prompts, params.n)
    recorder = _Recorder(metrics, ctx)
    handed_over = False
    span = trace.get_current_span()  # the request's root span (TracingMiddleware)
    span.set_attributes({"gen_ai.request.model": ctx.model, "strata.response_id": ctx.response_id,
                         "strata.num_choices": len(specs)})

    def on_close() -> None:
        fanout.cancel()
        recorder.done(usage, completed=fanout.finished)
        span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                             "gen_ai.usage.output_tokens": usage.completion_tokens})

    try:
        if params.stream:
            first = await _cancel_on_disconnect(request, fanout.__anext__())
            handed_over = True  # from here on the response's on_close cleans up
            body = _stream(ctx, params, renderer, first, fanout, usage, recorder, len(specs))
            return _ChoiceStream(body, on_close)
        body = await _cancel_on_disconnect(request, _collect(ctx, renderer, fanout, usage, recorder,
                                                             len(specs)))
        return JSONResponse(body)
    except _ClientDisconnected:
        return Response(status_code=499)
    finally:
        if not handed_over:
            on_close()


async def _collect(ctx: RequestContext, renderer: Renderer, fanout: FanOut, usage: Usage,
                   recorder: _Recorder, num_choices: int) -> dict:
    results = [ChoiceResult(i) for i in range(num_choices)]
    async for step in fanout:
        usage.update(step)
        recorder.step(step)
        result = results[step.index]
        result.text += step.text
        result.logprobs.extend(step.logprobs)
        if step.finish_reason is not None:
            result.finish_reason, result.stop_reason = step.finish_reason, step.stop_reason
    choices = [await renderer.full_choice(result) for result in results]
    return {"id": ctx.response_id, "object": renderer.response_object, "created": ctx.created,
            "model": ctx.model, "choices": choices, "usage": usage.as_dict()}


class _ChoiceStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends, even when the client left before
    the body iterator started (then the iterator's own cleanup never runs)."""

    def __init__(self, body: AsyncIterator[bytes], on_close) -> None:
        super().__init__(body, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _stream(ctx: RequestContext, params: GenerationParams, renderer: Renderer, first: Step,
                  fanout: FanOut, usage: Usage, recorder: _Recorder,
                  num_choices: int) -> AsyncIterator[bytes]:
    continuous = params.include_usage and params.continuous_usage_stats

    def chunk(choices: list[dict], with_usage: bool = continuous) -> bytes:
        payload = {"id": ctx.response_id, "object": renderer.chunk_object, "created": ctx.created,
                   "model": ctx.model, "choices": choices}
        if params.include_usage:
            payload["usage"] = usage.as_dict() if with_usage else None
        return sse.event(payload)

    try:
        for choice in renderer.preamble(list(range(num_choices))):
            yield chunk([choice])
        step: Step | None = first
        while step is not None:
            usage.update(step)
            recorder.step(step)
            choice = await renderer.stream_choice(step)
            if choice is not None:
                yield chunk([choice])
            step = await anext(fanout, None)
        if params.include_usage:
            yield chunk([], with_usage=True)
        yield sse.DONE
    except OpenAIError as error:
        for event in sse.error_events(error):
            yield event
    finally:
        fanout.cancel()
