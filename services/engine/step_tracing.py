"""Step spans (`strata engine --trace-steps`): one span per engine step, linked to the engine spans of
the requests the step served, so a slow request's trace leads to the steps it shared and with whom
(TGI's batch spans are the model).

A step serves many requests, so its span is the root of a trace of its own, carrying an
OpenTelemetry link to each request's `Generate` span (link attributes: the engine request id and the
tokens the step computed for it), not a child of any one of them. Span ``engine.step``, attributes
``strata.step.batch_size``, ``num_prefill_tokens``, ``num_decode_tokens``, ``time_s``,
``num_preemptions`` (by this step's schedule) and ``num_waiting`` (after it), and
``strata.replica_id``. ``sample_ratio`` keeps that fraction of the steps, drawn at random.

Contract: ``register(request_id, span_context)`` before a request reaches the engine loop and
``forget(request_id)`` once its caller is done (from the asyncio side); ``observe(...)`` after each
step, from the engine loop thread, before the step's outputs are delivered (so a request that
finished in it is still registered). A step not drawn costs one random number; a drawn one, a span
and a dictionary look-up per request. Single ``dict`` operations are atomic, so the two threads
share the registry without a lock.
"""

import random
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind

from services.engine.scheduler_output import SchedulerOutput

STEP_SPAN_NAME = "engine.step"
_NO_PARENT = otel_context.Context()  # a step span starts a trace: it is linked to requests, not under one


class StepTracer:
    def __init__(self, sample_ratio: float = 1.0, replica_id: str = "", tracer: trace.Tracer | None = None,
                 seed: int | None = None) -> None:
        """``tracer``: default, the process's (`services.common.telemetry`); ``seed``: of the draws."""
        if not 0 < sample_ratio <= 1:
            raise ValueError(f"--trace-steps-sample {sample_ratio:g} must be in (0, 1]: the fraction of steps traced")
        self.sample_ratio = sample_ratio
        self.replica_id = replica_id
        self._tracer = tracer or trace.get_tracer("strata.engine")
        self._span_contexts: dict[str, SpanContext] = {}  # by engine request id
        self._random = random.Random(seed)

    def register(self, request_id: str, span_context: SpanContext) -> None:
        """Steps serving ``request_id`` link to ``span_context`` (ignored when it is not a real span's)."""
        if span_context.is_valid:
            self._span_contexts[request_id] = span_context

    def forget(self, request_id: str) -> None:
        self._span_contexts.pop(request_id, None)

    def observe(self, scheduled: SchedulerOutput | None, step_seconds: float, num_waiting: int) -> None:
        """The span of the step that just ran ``scheduled`` in ``step_seconds``, if it is drawn."""
        if scheduled is None or not scheduled.chunks:
            return
        if self.sample_ratio < 1 and self._random.random() >= self.sample_ratio:
            return
        end_ns = time.time_ns()
        links = []
        for chunk in scheduled.chunks:
            request_id = chunk.request.request_id
            span_context = self._span_contexts.get(request_id)
            if span_context is not None:
                links.append(Link(span_context, {"strata.engine_request_id": request_id,
                                                 "strata.step.num_new_tokens": chunk.num_new_tokens}))
        attributes = {
            "strata.replica_id": self.replica_id,
            "strata.step.batch_size": len(scheduled.chunks),
            "strata.step.num_prefill_tokens": scheduled.num_prefill_tokens,
            "strata.step.num_decode_tokens": scheduled.num_decode_tokens,
            "strata.step.time_s": step_seconds,
            "strata.step.num_preemptions": len(scheduled.preempted),
            "strata.step.num_waiting": num_waiting,
        }
        span = self._tracer.start_span(STEP_SPAN_NAME, context=_NO_PARENT, kind=SpanKind.INTERNAL, links=links,
                                       attributes=attributes, start_time=end_ns - round(step_seconds * 1e9))
        span.end(end_time=end_ns)
