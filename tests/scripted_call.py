"""A scripted gRPC bidi call, for the shared-stream tests (tests/common/test_shared_generate.py)."""

import asyncio

import grpc


class ScriptedCall:
    """A bidi call: records the messages written; ``answer`` is called with each and returns the
    reply to read (None: none). ``gate`` holds writes while cleared."""

    def __init__(self, answer) -> None:
        self.written: list = []
        self.half_closed = self.cancelled = False
        self.gate = asyncio.Event()
        self.gate.set()
        self._answer = answer
        self._replies: asyncio.Queue = asyncio.Queue()

    async def write(self, message) -> None:
        await self.gate.wait()
        self.written.append(message)
        reply = self._answer(message)
        if reply is not None:
            self._replies.put_nowait(reply)

    async def read(self):
        reply = await self._replies.get()
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def done_writing(self) -> None:
        self.half_closed = True
        self._replies.put_nowait(grpc.aio.EOF)

    def fail(self, error: Exception) -> None:
        self._replies.put_nowait(error)

    def cancel(self) -> None:
        self.cancelled = True


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset"
