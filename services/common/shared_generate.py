"""Generation on an engine's GenerateMany stream, shared by many requests (`shared_stream`): a request
starts as an item of the stream's next message, its outputs come back among the other requests' in
the replies, and cancelling it sends an abort.

A request's call reads as its own Generate call would: ``GenerateResponse``s up to the one with a
finish reason, or a `grpc.aio.AioRpcError` with the status its own stream would have ended with (an
INVALID_ARGUMENT's parameter and OpenAI code in its status details, as the engine sends them), so the
gateway and the router handle both kinds of call alike. Used by the gateway towards its engine (or a
router) and by the router towards each engine replica, for requests whose trace is not recorded
(`shared_stream.in_sampled_trace`); where the server does not answer GenerateMany
(`EngineInfoResponse.generate_many`) they use Generate.
"""

import asyncio
from collections.abc import Callable

import grpc

from services.common import error_details
from services.common.errors import InvalidRequestError
from services.common.inbox import Inbox
from services.common.pb import engine_pb2
from services.common.shared_stream import SharedStream, SharedStreams

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_error(code: grpc.StatusCode, details: str, param: str | None = None,
                 error_code: str | None = None) -> grpc.aio.AioRpcError:
    """The error a Generate call raises for this status (param and OpenAI code in its details)."""
    trailing = ()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        trailing = error_details.trailing_metadata(InvalidRequestError(details, param=param, code=error_code))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def _from_request_error(error: engine_pb2.RequestError) -> grpc.aio.AioRpcError:
    return status_error(_STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN), error.message,
                        error.param or None, error.error_code or None)


# What grpc's aio client reads in place of the server's status when an operation on the call failed in
# its core, as when the connection breaks while a message is being written: the server went away (seen
# once in the fleet's kill -9 test: a request written to the stream of a replica just killed came back
# as INTERNAL, which the router does not retry, where UNAVAILABLE sends it to another replica).
_CORE_FAILURE = "Internal error from Core"


def _stream_failure(server: str) -> Callable[[Exception | None], Exception]:
    def failure(error: Exception | None) -> Exception:
        if isinstance(error, grpc.aio.AioRpcError):
            if error.code() == grpc.StatusCode.INTERNAL and error.details() == _CORE_FAILURE:
                return status_error(grpc.StatusCode.UNAVAILABLE,
                                    f"the shared GenerateMany stream to the {server} broke ({_CORE_FAILURE})")
            return error
        reason = f"failed: {error!r}" if error is not None else "ended it early"
        return status_error(grpc.StatusCode.UNAVAILABLE, f"the shared GenerateMany stream to the {server} {reason}")
    return failure


class SharedGenerate:
    """Starts requests on the current GenerateMany stream to ``server`` (its name in errors);
    ``open_call()`` makes a new one's gRPC call. Create inside the event loop."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], server: str = "engine",
                 timeout_s: float = 3600.0) -> None:
        self._streams = SharedStreams(lambda: _GenerateStream(open_call(), _stream_failure(server)))
        self.timeout_s = timeout_s  # each request's deadline, as a Generate call's own

    def running(self, request_id: str) -> bool:
        """Whether a request of this id runs on the current stream (a second one would be refused)."""
        latest = self._streams.latest
        return latest is not None and not latest.stream.closing and request_id in latest.calls

    def generate(self, request: engine_pb2.GenerateRequest) -> "SharedGenerateCall":
        return SharedGenerateCall(self._streams.current(), request, self.timeout_s)

    def close(self, reason: str) -> None:
        """Fails the requests on the current stream (UNAVAILABLE: ``reason``)."""
        self._streams.close(status_error(grpc.StatusCode.UNAVAILABLE, reason))


class _GenerateStream:
    """Items are a GenerateRequest (start it) or a request id (abort it); replies go to the request's
    call by id."""

    def __init__(self, call: grpc.aio.StreamStreamCall, failure: Callable[[Exception | None], Exception]) -> None:
        self.calls: dict[str, SharedGenerateCall] = {}
        self.stream = SharedStream(call, self._message, self._on_reply, self._on_fail, failure)

    @staticmethod
    def _message(items: list) -> engine_pb2.GenerateManyRequest:
        message = engine_pb2.GenerateManyRequest(next_token_entries=True)  # (SharedGenerateCall reads them)
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
            result = output.WhichOneof("result")
            if result == "next_token":
                call.next_token(output.next_token)
            elif result == "error":
                call.deliver(_from_request_error(output.error))
            else:
                call.deliver(output.output)

    def _on_fail(self, error: Exception, unsent: list) -> None:
        for call in list(self.calls.values()):
            call.deliver(error)


def _next_output(last: engine_pb2.GenerateResponse | None, token_id: int) -> engine_pb2.GenerateResponse:
    """The output a `next_token` entry stands for: ``token_id`` alone, with ``last``'s usage (the
    request's previous output) one completion token further, and its replica."""
    output = engine_pb2.GenerateResponse(token_ids=[token_id])
    if last is not None:
        output.usage.CopyFrom(last.usage)
        output.replica_id = last.replica_id
    output.usage.completion_tokens += 1
    return output


class SharedGenerateCall:
    """One request's outputs, iterated (or ``read()``, EOF after the last) as a Generate call's, or
    handed to a listener as they come (`listen`); past ``timeout_s`` it raises DEADLINE_EXCEEDED and
    the request is aborted. ``cancel()`` aborts the request in the engine."""

    def __init__(self, owner: _GenerateStream, request: engine_pb2.GenerateRequest, timeout_s: float) -> None:
        self._owner = owner
        self._id = request.request_id
        self._outputs: Inbox[engine_pb2.GenerateResponse | Exception] = Inbox()
        self._listener: Callable[[engine_pb2.GenerateResponse | Exception], None] | None = None
        self._token_listener: Callable[[int], None] | None = None
        self._last: engine_pb2.GenerateResponse | None = None  # the last output, for a next_token's usage
        self._done = False
        owner.stream.send(request)
        owner.calls[self._id] = self
        owner.stream.join()
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def listen(self, listener: Callable[[engine_pb2.GenerateResponse | Exception], None],
               token_listener: Callable[[int], None] | None = None) -> None:
        """Hands each output to ``listener`` as soon as it is read, inside the reading of the stream's
        reply (no task woken per output), up to the one with a finish reason or the error that ends
        the call; in place of iterating. With ``token_listener``, an output of one token and nothing
        else but a usage one completion token past the previous output's (a `next_token` entry) goes to
        it as the token id instead. Call it right after `SharedGenerate.generate`, before the caller
        awaits anything: the replies are read by another task, so none has come yet."""
        assert self._outputs.empty(), "listen() after outputs came"
        self._listener, self._token_listener = listener, token_listener

    def deliver(self, output: engine_pb2.GenerateResponse | Exception) -> None:
        if self._listener is None:
            self._outputs.put(output)
            if not isinstance(output, Exception):
                self._last = output
            return
        if self._done:
            return
        if isinstance(output, Exception) or output.finish_reason:
            self._end()
        elif self._token_listener is None:
            self._last = output
        self._listener(output)

    def next_token(self, token_id: int) -> None:
        """A `next_token` entry: to the token listener, else as the output it stands for."""
        if self._token_listener is not None:
            if not self._done:
                self._token_listener(token_id)
            return
        self.deliver(_next_output(self._last, token_id))

    def pending(self) -> bool:
        """Whether outputs came that were not read yet."""
        return not self._outputs.empty()

    def __aiter__(self) -> "SharedGenerateCall":
        return self

    async def __anext__(self) -> engine_pb2.GenerateResponse:
        if self._done:
            raise StopAsyncIteration
        output = await self._outputs.get()
        if isinstance(output, Exception):
            self._end()
            raise output
        if output.finish_reason:
            self._end()
        return output

    async def read(self):
        """The next output, or ``grpc.aio.EOF`` after the last (as a Generate call's ``read``)."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return grpc.aio.EOF

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
        self.deliver(status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._deadline.cancel()
            self._owner.calls.pop(self._id, None)
            self._owner.stream.leave()
