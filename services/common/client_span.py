"""A CLIENT span for each outgoing gRPC call, so a trace shows the time between hops.

    call = client_span.call("strata.v1.Engine/Generate", target,
                            lambda metadata: stub.Generate(request, timeout=t, metadata=metadata))

``call`` starts a CLIENT span (``rpc.system=grpc``, ``rpc.service``, ``rpc.method``,
``server.address``/``server.port``, ``strata.request_id``), makes the call with metadata that carries
that span's W3C trace context (``traceparent``) and the request id (``x-request-id``), and ends the span
when the call is done: a unary call's reply, a stream's last message or its cancellation. A status
other than OK is an error on the span, except CANCELLED: the caller cancels a stream once it has what
it needs (the gateway as the last token arrives), which is no failure of the callee.

Outside a trace (a router's health checks, a scrape) there is no span, and only the request id, if
any, goes along. This is not a channel interceptor, which is what opentelemetry-instrumentation-grpc
is: grpc.aio relays every message of an intercepted stream through an extra queue and task (a cost
paid per generated token), and that instrumentation hands back an async generator in place of a
stream's call object, which has no ``read``/``write``/``done_writing`` for the gateway's Detokenize
stream.
"""

import asyncio
from collections.abc import Callable
from functools import partial

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.common import request_id

tracer = trace.get_tracer("strata.grpc.client")
_finishing: set[asyncio.Task] = set()  # tasks reading a finished call's status, kept until they end


def call(method: str, target: str, invoke: Callable[[tuple[tuple[str, str], ...]], grpc.aio.Call]):
    """``invoke(metadata)`` (a call on a ``grpc.aio`` stub) under a CLIENT span named ``method``
    ("package.Service/Method"), ``target`` being the server's "host:port"; returns the call."""
    current_id = request_id.current()
    id_metadata = ((request_id.METADATA_KEY, current_id),) if current_id else ()
    if not trace.get_current_span().get_span_context().is_valid:
        return invoke(id_metadata)
    service, _, rpc = method.partition("/")
    host, _, port = target.rpartition(":")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc,
                  "server.address": host or target}
    if port.isdigit():
        attributes["server.port"] = int(port)
    if current_id:
        attributes[request_id.SPAN_ATTRIBUTE] = current_id
    span = tracer.start_span(method, kind=SpanKind.CLIENT, attributes=attributes)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    try:
        rpc_call = invoke((*carrier.items(), *id_metadata))
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()
        raise
    rpc_call.add_done_callback(partial(_on_done, span))
    return rpc_call


def _on_done(span: Span, rpc_call: grpc.aio.Call) -> None:
    if rpc_call.cancelled():
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
        span.end()
        return
    task = asyncio.ensure_future(_end_with_status(span, rpc_call))  # the status is read by awaiting
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)


async def _end_with_status(span: Span, rpc_call: grpc.aio.Call) -> None:
    try:
        code = await rpc_call.code()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {await rpc_call.details()}"))
    finally:
        span.end()
