"""OpenTelemetry tracing for every service: one request is one trace, from the gateway's HTTP span
through every gRPC hop (tokenizer, router, engine), with W3C trace context (``traceparent``) carried
in gRPC metadata and HTTP headers.

``setup_tracing(service)`` exports spans over OTLP/gRPC when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, with the standard OTEL_* variables for the rest
(``OTEL_SERVICE_NAME``, ``OTEL_BSP_SCHEDULE_DELAY``, ...); otherwise spans are not recorded and only
the context still flows, so a service behind a traced one keeps the trace whole. The servers'
interceptor lives in ``grpc_server.py``; the clients' here.
"""

import atexit
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
tracer = trace.get_tracer("strata")


def setup_tracing(service_name: str) -> bool:
    """Installs the process's tracer provider; returns whether spans are exported."""
    if not any(os.environ.get(name) for name in _ENDPOINT_VARIABLES):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # flushes what is still queued
    return True


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """The trace context a request came with (``traceparent``), or an empty one."""
    return propagate.extract(carrier)


@contextmanager
def server_span(name: str, carrier: Mapping[str, str], attributes: Mapping | None = None) -> Iterator[Span]:
    """A SERVER span, current for the block, continuing the caller's trace from ``carrier``. An exception
    leaving the block is recorded on it and marks it as an error."""
    with tracer.start_as_current_span(name, context=extract(carrier), kind=SpanKind.SERVER,
                                      attributes=dict(attributes or {}), record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise


def grpc_metadata_carrier(metadata: Iterable | None) -> dict[str, str]:
    return {key: value for key, value in (metadata or ()) if isinstance(value, str)}


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context (``traceparent``, ``tracestate``) as gRPC metadata; empty outside a
    trace. Pass it as a call's ``metadata=`` where a channel has no interceptors (a stream's
    interceptor costs a queue and a task per message)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """The call's details with the current trace context added to its metadata."""
    context = trace_metadata()
    if not context:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in context:
        metadata[key] = value
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


# grpc.aio files an interceptor under the first of the four kinds it is an instance of, so each kind
# gets its own class.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


def client_interceptors() -> list:
    """Interceptors for a ``grpc.aio`` channel that carry the trace context to the server."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]
