"""Generation on the engine's GenerateMany stream, shared by the gateway's untraced requests
(`shared_stream`): a request starts as an item of the stream's next message, its outputs come back
among the other requests' in the replies, and cancelling it sends an abort.

Used when the engine says it answers GenerateMany (`EngineInfoResponse.generate_many`; a router does
not); traced requests keep a Generate stream of their own (`upstream.py`, `shared_stream.in_sampled_trace`).
"""

import asyncio
from collections.abc import Callable

import grpc

from services.common.pb import engine_pb2
from services.gateway import errors
from services.gateway.shared_stream import SharedStream, SharedStreams


class SharedGenerate:
    """Starts requests on the current GenerateMany stream; ``open_call()`` makes a new one's gRPC
    call. Create inside the event loop."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], timeout_s: float = 3600.0) -> None:
        self._streams = SharedStreams(lambda: _GenerateStream(open_call()))
        self.timeout_s = timeout_s  # each request's deadline, as a Generate call's own

    def running(self, request_id: str) -> bool:
        """Whether a request of this id runs on the current stream (a second one would be refused)."""
        latest = self._streams.latest
        return latest is not None and not latest.stream.closing and request_id in latest.calls

    def generate(self, request: engine_pb2.GenerateRequest) -> "SharedGenerateCall":
        return SharedGenerateCall(self._streams.current(), request, self.timeout_s)

    def close(self) -> None:
        self._streams.close()


class _GenerateStream:
    """Items are a GenerateRequest (start it) or a request id (abort it); replies go to the request's
    call by id."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.calls: dict[str, SharedGenerateCall] = {}
        self.stream = SharedStream(call, "engine", self._message, self._on_reply, self._on_fail)

    @staticmethod
    def _message(items: list) -> engine_pb2.GenerateManyRequest:
        message = engine_pb2.GenerateManyRequest()
        for item in items:
            if isinstance(item, str):
                message.abort_request_ids.append(item)
            else:
                message.requests.append(item)
        return message

    def _on_reply(self, reply: engine_pb2.GenerateManyResponse) -> None:
        for output in reply.outputs:
            call = self.calls.get(output.request_id)
            if call is None:  # cancelled while its output was on the way
                continue
            if output.HasField("error"):
                call.deliver(errors.from_request_error(output.error, "engine"))
            else:
                call.deliver(output.output)

    def _on_fail(self, error: errors.OpenAIError, unsent: list) -> None:
        for call in list(self.calls.values()):
            call.deliver(error)


class SharedGenerateCall:
    """One request's outputs (``GenerateResponse``s up to the one with a finish reason), iterated as
    a Generate call's; an error raises the `OpenAIError` its own stream's status would map to (past
    ``timeout_s``, DEADLINE_EXCEEDED's, and the request is aborted). ``cancel()`` aborts the request
    in the engine."""

    def __init__(self, owner: _GenerateStream, request: engine_pb2.GenerateRequest, timeout_s: float) -> None:
        self._owner = owner
        self._id = request.request_id
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._done = False
        owner.stream.send(request)
        owner.calls[self._id] = self
        owner.stream.join()
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def deliver(self, output: engine_pb2.GenerateResponse | errors.OpenAIError) -> None:
        self._outputs.put_nowait(output)

    def __aiter__(self) -> "SharedGenerateCall":
        return self

    async def __anext__(self) -> engine_pb2.GenerateResponse:
        if self._done:
            raise StopAsyncIteration
        output = await self._outputs.get()
        if isinstance(output, errors.OpenAIError):
            self._end()
            raise output
        if output.finish_reason:
            self._end()
        return output

    def cancel(self) -> None:
        if self._done:
            return
        if self._owner.stream.error is None:
            self._owner.stream.send(self._id)
        self._end()

    def _expire(self) -> None:
        if self._done:
            return
        if self._owner.stream.error is None:
            self._owner.stream.send(self._id)
        self.deliver(errors.from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "engine",
                                        lambda: (None, None)))

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._deadline.cancel()
            self._owner.calls.pop(self._id, None)
            self._owner.stream.leave()
