"""Detokenization on the tokenizer's DetokenizeMany stream, shared by the gateway's untraced
generations (`services/common/shared_stream`): a generation's ids become an item of the stream's next
message, and each message's reply holds one delta per item, in order.

Traced requests keep a Detokenize stream of their own (`generation.py`, `shared_stream.in_sampled_trace`).
"""

import asyncio
import itertools
from collections import deque
from collections.abc import Callable

import grpc

from services.common.pb import tokenizer_pb2
from services.common.shared_stream import SharedStream, SharedStreams
from services.gateway import errors


class SharedDetokenize:
    """Opens generations on the current DetokenizeMany stream; ``open_call()`` makes a new one's gRPC
    call. Create inside the event loop."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._streams = SharedStreams(lambda: _DetokenizeStream(open_call()))
        self._ids = itertools.count(1)

    def open(self, prefix_ids: list[int], skip_special_tokens: bool) -> "SharedGeneration":
        """A generation whose text continues after ``prefix_ids``."""
        return SharedGeneration(self._streams.current().stream, next(self._ids), prefix_ids, skip_special_tokens)

    def close(self) -> None:
        self._streams.close(errors.OpenAIError("the gateway is closing its upstream streams", 503))


class _DetokenizeStream:
    """Items are (DetokenizeItem, future of its DetokenizeDelta); replies come in message order."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._awaiting: deque[list[asyncio.Future]] = deque()  # per message written, its items' replies
        self.stream = SharedStream(call, self._message, self._on_reply, self._on_fail, _failure)

    def _message(self, items: list) -> tokenizer_pb2.DetokenizeManyRequest:
        self._awaiting.append([reply for _, reply in items])
        return tokenizer_pb2.DetokenizeManyRequest(items=[item for item, _ in items])

    def _on_reply(self, reply: tokenizer_pb2.DetokenizeManyResponse) -> None:
        for waiting, delta in zip(self._awaiting.popleft(), reply.deltas):
            if not waiting.done():
                waiting.set_result(delta)

    def _on_fail(self, error: Exception, unsent: list) -> None:
        pending = [reply for _, reply in unsent] + [reply for replies in self._awaiting for reply in replies]
        self._awaiting.clear()
        for reply in pending:
            if not reply.done():
                reply.set_exception(error)
                reply.exception()  # a generation that was cancelled never reads it: no "never retrieved" log


def _failure(error: Exception | None) -> errors.OpenAIError:
    if isinstance(error, grpc.RpcError):
        return errors.from_grpc(error, "tokenizer")
    if error is None:
        return errors.OpenAIError("the tokenizer ended a shared stream early", 502)
    return errors.OpenAIError(f"tokenizer stream failed: {error!r}", 502)


class SharedGeneration:
    """One generation on a shared stream, with `generation._Detokenizer`'s interface: ``write`` ids,
    ``read`` each write's delta in order, ``finish`` for the held-back rest, ``cancel`` (synchronous)."""

    def __init__(self, stream: SharedStream, generation_id: int, prefix_ids: list[int],
                 skip_special_tokens: bool) -> None:
        self._stream = stream
        self._id = generation_id
        self._first = tokenizer_pb2.DetokenizeItem(generation_id=generation_id, skip_special_tokens=skip_special_tokens,
                                                   prefix_token_ids=prefix_ids)
        self._replies: deque[asyncio.Future] = deque()
        self._opened = self._closed = False
        stream.join()

    async def write(self, token_ids) -> bool:
        """Queues ids; returns whether a reply will come for them (none for no ids)."""
        if not token_ids:
            return False
        item = tokenizer_pb2.DetokenizeItem(generation_id=self._id) if self._opened else self._first
        item.token_ids.extend(token_ids)
        self._replies.append(self._send(item))
        self._opened = True
        return True

    async def read(self) -> str:
        """The text delta of the oldest write not read yet."""
        return self._text(await self._replies.popleft())

    async def finish(self) -> str:
        """Ends the generation and returns any text the tokenizer still held; call it after reading
        the reply of the last write."""
        if self._closed:
            return ""
        reply = self._send(tokenizer_pb2.DetokenizeItem(generation_id=self._id, end=True)) if self._opened else None
        self._close()
        return self._text(await reply) if reply is not None else ""

    def cancel(self) -> None:
        if self._closed:
            return
        if self._opened and self._stream.error is None:  # the tokenizer forgets it
            self._send(tokenizer_pb2.DetokenizeItem(generation_id=self._id, end=True))
        self._close()

    def _send(self, item: tokenizer_pb2.DetokenizeItem) -> asyncio.Future:
        reply = asyncio.get_running_loop().create_future()
        self._stream.send((item, reply))
        return reply

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stream.leave()

    def _text(self, delta: tokenizer_pb2.DetokenizeDelta) -> str:
        if delta.error:
            self._close()  # the tokenizer closed it
            raise errors.OpenAIError(f"tokenizer failed: {delta.error}", 502)
        return delta.text_delta
