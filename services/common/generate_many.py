"""The server's side of GenerateMany: many requests over one gRPC stream (the engine's and the router's).

A Generate stream per request costs a gRPC message per request and token, and grpc.aio's cost per
message runs on the gRPC thread holding the GIL, which the engine's model thread then waits for: at
64 streams that slowed every decode step by about a fifth. Here each request runs as its server's
Generate would (``run_one(request)``: its outputs, or the exception its Generate call would end with),
in a task of its own that puts its outputs in the stream's outbox, and one sender sends everything in
the outbox as one message: an engine step delivers all its outputs in one callback on the event loop,
so its requests' outputs leave together.

A request that fails gets an error entry with the status its own Generate stream would have ended
with (`grpc_server.status_for`, or a relayed call's own status with its parameter); the stream and
its other requests go on. When the caller closes its side, the stream ends once its running requests
have; when it cancels, they are aborted.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from services.common import error_details
from services.common.errors import InvalidRequestError
from services.common.grpc_server import status_for
from services.common.pb import engine_pb2

log = logging.getLogger(__name__)

RunOne = Callable[[engine_pb2.GenerateRequest], AsyncIterator[engine_pb2.GenerateResponse]]


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


async def serve_generate_many(run_one: RunOne, request_iterator) -> AsyncIterator[engine_pb2.GenerateManyResponse]:
    """The GenerateMany stream over ``request_iterator``, each request run by ``run_one``."""
    outbox: list[engine_pb2.GenerateManyOutput] = []
    wake = asyncio.Event()
    running: dict[str, asyncio.Task] = {}

    def emit(output: engine_pb2.GenerateManyOutput) -> None:
        outbox.append(output)
        wake.set()

    async def run(request: engine_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        try:
            async with contextlib.aclosing(run_one(request)) as outputs:  # aborted at once when cancelled
                async for output in outputs:
                    emit(engine_pb2.GenerateManyOutput(request_id=request_id, output=output))
        except Exception as exc:
            emit(engine_pb2.GenerateManyOutput(request_id=request_id, error=request_error(exc)))
        finally:
            if running.get(request_id) is asyncio.current_task():
                del running[request_id]
            wake.set()

    def start(request: engine_pb2.GenerateRequest) -> None:
        if not request.request_id or request.request_id in running:
            problem = "is required" if not request.request_id else f"{request.request_id!r} is already running"
            emit(engine_pb2.GenerateManyOutput(request_id=request.request_id, error=request_error(
                InvalidRequestError(f"GenerateMany: request_id {problem}", param="request_id"))))
            return
        running[request.request_id] = asyncio.create_task(run(request))

    async def read_requests() -> None:
        async for message in request_iterator:
            for request_id in message.abort_request_ids:
                task = running.pop(request_id, None)
                if task is not None:
                    task.cancel()  # leaving run_one aborts the request (the engine frees its blocks)
            for request in message.requests:
                start(request)

    reader = asyncio.create_task(read_requests())
    reader.add_done_callback(lambda _: wake.set())
    try:
        while True:  # the state is checked before each wait: a request may end while its outputs are sent
            if outbox:
                outputs = outbox[:]
                outbox.clear()
                yield engine_pb2.GenerateManyResponse(outputs=outputs)
            elif reader.done() and (not running or reader.exception() is not None):
                reader.result()  # the caller's side failed: so does the stream
                return
            else:
                await wake.wait()
                wake.clear()
    finally:
        reader.cancel()
        for task in running.values():
            task.cancel()
