"""OpenTelemetry tracing for every service: one request is one trace, from the gateway's HTTP span
through every gRPC hop (tokenizer, router, engine), with W3C trace context (``traceparent``) carried
in gRPC metadata and HTTP headers.

``setup_tracing(service, instance_id)`` exports spans over OTLP/gRPC when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, with the standard OTEL_* variables for the rest
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_SCHEDULE_DELAY``, ...); otherwise spans
are not recorded and only the context still flows, so a service behind a traced one keeps the trace
whole. Each service's resource names it (``service.name``, ``service.version``) and the process
(``service.instance.id``: an engine's replica id, the router's id, else an id made per process). The
servers' spans are made in ``grpc_server.py``, the clients' in ``client_span.py``.
"""

import atexit
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.common import service_identity

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
tracer = trace.get_tracer("strata")


def setup_tracing(service_name: str, instance_id: str | None = None) -> bool:
    """Installs the process's tracer provider; returns whether spans are exported."""
    if not any(os.environ.get(name) for name in _ENDPOINT_VARIABLES):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    ours = Resource.create({"service.name": service_name, "service.version": service_identity.version(),
                            "service.instance.id": instance_id or service_identity.process_instance_id()})
    # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, when set, win over ours
    provider = TracerProvider(resource=ours.merge(OTELResourceDetector().detect()))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # flushes what is still queued
    return True


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """The trace context a request came with (``traceparent``), or an empty one."""
    return propagate.extract(carrier)


def start_server_span(name: str, carrier: Mapping[str, str], attributes: Mapping | None = None) -> Span:
    """A SERVER span continuing the caller's trace from ``carrier``, not made current: for a stream,
    which makes it current step by step (``trace.use_span``) so that no context is left attached
    across a ``yield``."""
    return tracer.start_span(name, context=extract(carrier), kind=SpanKind.SERVER,
                             attributes=dict(attributes or {}))


def mark_failed(span: Span, exc: BaseException) -> None:
    """Records ``exc`` on ``span`` and marks it as an error."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def is_marked(span: Span) -> bool:
    """Whether ``span`` has a status already (an error recorded where it was mapped to a status)."""
    status = getattr(span, "status", None)  # a span that is not recorded has none
    return status is not None and status.status_code is not StatusCode.UNSET


@contextmanager
def server_span(name: str, carrier: Mapping[str, str], attributes: Mapping | None = None) -> Iterator[Span]:
    """A SERVER span, current for the block, continuing the caller's trace from ``carrier``. An exception
    leaving the block is recorded on it and marks it as an error, unless the block marked the
    span itself (an error mapped to a gRPC status is recorded where it is mapped)."""
    with tracer.start_as_current_span(name, context=extract(carrier), kind=SpanKind.SERVER,
                                      attributes=dict(attributes or {}), record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit) and not is_marked(span):
                mark_failed(span, exc)
            raise


def grpc_metadata_carrier(metadata: Iterable | None) -> dict[str, str]:
    return {key: value for key, value in (metadata or ()) if isinstance(value, str)}
