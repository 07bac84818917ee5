"""The gRPC server every Strata service runs: errors mapped to status codes in one place, a trace
span per call, health, reflection, and a graceful stop on SIGTERM/SIGINT.

Servicers stay thin and raise domain errors; `ErrorMappingInterceptor` turns them into statuses:
InvalidRequestError -> INVALID_ARGUMENT, ResourceExhaustedError -> RESOURCE_EXHAUSTED and
ServiceUnavailableError -> UNAVAILABLE, with the error's message; anything else -> INTERNAL, logged
with its traceback. Usage:

    server = GrpcServer([TOKENIZER_SERVICE_NAME])                # inside a running event loop
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server.server)
    port = server.add_port("127.0.0.1:50051")                    # ":0" picks a free port
    await server.start()
    await server.set_serving()                                   # health says SERVING from now on
    await server.wait_for_termination()                          # until SIGTERM/SIGINT, then stops
"""

import asyncio
import inspect
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.common import error_details, request_id, telemetry
from services.common.errors import InvalidRequestError, ResourceExhaustedError, ServiceUnavailableError
from services.common.tls import TlsFiles

log = logging.getLogger(__name__)

STATUS_BY_ERROR = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ServiceUnavailableError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed RPC returns for `exc`."""
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def rewrap_handler(handler: grpc.RpcMethodHandler, wrap) -> grpc.RpcMethodHandler:
    """The same handler with its behavior replaced by ``wrap(behavior)``, whatever its streaming kind."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            wrap(handler.unary_unary), handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream), handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            wrap(handler.stream_unary), handler.request_deserializer, handler.response_serializer
        )
    return grpc.stream_stream_rpc_method_handler(
        wrap(handler.stream_stream), handler.request_deserializer, handler.response_serializer
    )


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler so that an exception becomes the status `status_for` picks."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return rewrap_handler(handler, lambda behavior: _mapped(behavior, handler_call_details.method))


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per RPC (a stream's lasting until it ends), continuing the caller's trace from
    the call's metadata and current while the servicer runs, so a servicer can add attributes to
    `trace.get_current_span()`; the request id (``x-request-id`` metadata, else a unary request's own
    ``request_id`` field) is bound for the call (`services.common.request_id`) and set on the span.
    Health and reflection calls are not traced, nor streams shared by many requests (``GenerateMany``:
    such a stream belongs to no one trace), and the polling and start-up RPCs (``Info``, ``Load``: a
    router's checks every second; ``Decoder``: a gateway's fetch at start) only when the caller is inside
    a trace."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith("/grpc."):
            return handler
        name = method.lstrip("/")
        service, _, rpc = name.partition("/")
        if rpc in SHARED_RPCS:
            return handler
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}
        polling = rpc in POLLING_RPCS
        return rewrap_handler(handler, lambda behavior: _traced(behavior, name, attributes, polling))


POLLING_RPCS = frozenset({"Info", "Load", "Decoder"})
SHARED_RPCS = frozenset({"GenerateMany"})


def _call_facts(request, context, attributes: dict) -> tuple[dict[str, str], str | None, dict]:
    """The call's trace carrier, its request id and its span's attributes."""
    carrier = telemetry.grpc_metadata_carrier(context.invocation_metadata())
    given = carrier.get(request_id.METADATA_KEY) or getattr(request, "request_id", None) or None
    if given is None:
        return carrier, None, attributes
    return carrier, given, {**attributes, request_id.SPAN_ATTRIBUTE: given}


def _traced(behavior, name: str, attributes: dict, only_in_a_trace: bool = False):
    if only_in_a_trace:  # unary; a root span of its own would be noise

        async def polled(request, context):
            carrier, given_id, span_attributes = _call_facts(request, context, attributes)
            if "traceparent" not in carrier:
                return await behavior(request, context)
            with request_id.bound(given_id), telemetry.server_span(name, carrier, span_attributes):
                return await _aborting_marks_span(behavior(request, context), context)

        return polled
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            carrier, given_id, span_attributes = _call_facts(request, context, attributes)
            span = telemetry.start_server_span(name, carrier, span_attributes)
            with_span = trace.set_span_in_context(span)
            responses = behavior(request, context)
            try:
                while True:
                    # current for each step only: a context attached across a yield would be detached
                    # from another task when the stream is closed from outside ("Failed to detach
                    # context"); attach/detach rather than context managers: this runs per message
                    bound, attached = request_id.bind(given_id), otel_context.attach(with_span)
                    try:
                        response = await anext(responses)
                    except StopAsyncIteration:
                        return
                    except grpc.aio.AbortError:
                        _mark_aborted(span, context)
                        raise
                    finally:
                        otel_context.detach(attached)
                        request_id.unbind(bound)
                    yield response
            except BaseException as exc:
                if not isinstance(exc, GeneratorExit) and not telemetry.is_marked(span):
                    telemetry.mark_failed(span, exc)
                raise
            finally:
                await responses.aclose()
                span.end()

        return stream

    async def call(request, context):
        carrier, given_id, span_attributes = _call_facts(request, context, attributes)
        with request_id.bound(given_id), telemetry.server_span(name, carrier, span_attributes):
            return await _aborting_marks_span(behavior(request, context), context)

    return call


async def _aborting_marks_span(step, context: grpc.aio.ServicerContext):
    """Awaits ``step``; a servicer's own ``context.abort`` marks the current span with its status."""
    try:
        return await step
    except grpc.aio.AbortError:
        _mark_aborted(trace.get_current_span(), context)
        raise


def _mark_aborted(span, context: grpc.aio.ServicerContext) -> None:
    """The status a servicer aborted with, on its span (unless the error mapping recorded one)."""
    if not telemetry.is_marked(span):
        code = context.code()
        span.set_status(Status(StatusCode.ERROR, f"{getattr(code, 'name', code)}: {context.details()}"))


def _mapped(behavior, method: str):
    """`behavior` (a coroutine or async generator function) with its exceptions turned into statuses."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc, method)

        return stream

    async def call(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method)

    return call


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """Ends the call with the status ``exc`` maps to; the exception is recorded on the call's span
    (current here: the tracing interceptor is the outer one)."""
    code, message = status_for(exc)
    telemetry.mark_failed(trace.get_current_span(), exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    details = error_details.trailing_metadata(exc) if isinstance(exc, InvalidRequestError) else ()
    await context.abort(code, message, trailing_metadata=details)


class GrpcServer:
    """A `grpc.aio` server with error mapping, health and reflection; the caller adds its servicers.

    Health reports NOT_SERVING for the whole server ("") and for each name in `service_names` until
    `set_serving()`; `stop()` reports NOT_SERVING, then lets in-flight RPCs finish for `grace_s`.
    Build it inside the event loop that will run it.
    """

    def __init__(self, service_names: Iterable[str], *, grace_s: float = 5.0, options: Iterable = ()) -> None:
        self.service_names = tuple(service_names)
        self.grace_s = grace_s
        # tracing is outermost, so the error mapping runs (and logs) inside the call's span and request id
        self.server = grpc.aio.server(interceptors=[TracingInterceptor(), ErrorMappingInterceptor()],
                                      options=list(options))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )

    def add_port(self, address: str, tls: TlsFiles | None = None) -> int:
        """Listens on `address`, such as "127.0.0.1:50051", with TLS when ``tls`` is given (mTLS when it
        names a CA; `services.common.tls`); returns the bound port."""
        if tls is not None:
            port = self.server.add_secure_port(address, tls.server_credentials())
        else:
            port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        return port

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self._health.set(name, status)

    async def stop(self) -> None:
        await self._health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)

    async def wait_for_termination(self) -> None:
        """Serves until SIGTERM or SIGINT, then stops gracefully."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop_requested.set)
        try:
            await stop_requested.wait()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            await self.stop()
