"""The gateway's shared upstream streams (DetokenizeMany, GenerateMany) against a scripted call: what
many requests queue during a write goes out as one message, replies reach the request they belong
to, the stream half-closes when its last request leaves, and a failed stream fails its requests and
is replaced by the next request's."""

import asyncio

import grpc
import pytest

from services.common.pb import engine_pb2, tokenizer_pb2
from services.gateway.errors import OpenAIError
from services.gateway.shared_detokenize import SharedDetokenize
from services.gateway.shared_generate import SharedGenerate


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


def echo_text(message: tokenizer_pb2.DetokenizeManyRequest) -> tokenizer_pb2.DetokenizeManyResponse:
    """Each id's text is "<id>"; an item with `end` gets "." for the held-back rest."""
    return tokenizer_pb2.DetokenizeManyResponse(deltas=[
        tokenizer_pb2.DetokenizeDelta(text_delta="".join(f"<{i}>" for i in item.token_ids) + ("." if item.end else ""))
        for item in message.items])


def test_ids_queued_during_a_write_go_out_together_and_each_reply_reaches_its_generation():
    async def run():
        calls = []
        shared = SharedDetokenize(lambda: calls.append(ScriptedCall(echo_text)) or calls[-1])
        generations = [shared.open([1, 2], skip_special_tokens=True) for _ in range(10)]
        calls[0].gate.clear()  # the first write waits: what the others queue meanwhile goes next, together
        await generations[0].write([100])
        await asyncio.sleep(0)
        for k, generation in enumerate(generations[1:], 1):
            await generation.write([100 + k])
        calls[0].gate.set()
        texts = [await generation.read() for generation in generations]
        tails = [await generation.finish() for generation in generations]
        await asyncio.sleep(0.01)
        return calls, texts, tails

    calls, texts, tails = asyncio.run(run())
    assert len(calls) == 1
    sizes = [len(message.items) for message in calls[0].written]
    assert sizes[:2] == [1, 9], sizes  # then the ends
    assert texts == [f"<{100 + k}>" for k in range(10)] and tails == ["."] * 10
    first_items = [item for message in calls[0].written[:2] for item in message.items]
    assert all(list(item.prefix_token_ids) == [1, 2] and item.skip_special_tokens for item in first_items)
    assert calls[0].half_closed  # the last generation left: the stream is closed


def test_a_cancelled_generation_is_forgotten_upstream_and_an_idle_gateway_opens_a_new_stream_later():
    async def run():
        calls = []
        shared = SharedDetokenize(lambda: calls.append(ScriptedCall(echo_text)) or calls[-1])
        generation = shared.open([], skip_special_tokens=False)
        await generation.write([7])
        generation.cancel()
        await asyncio.sleep(0.01)
        later = shared.open([], skip_special_tokens=False)
        await later.write([8])
        text = await later.read()
        return calls, text

    calls, text = asyncio.run(run())
    assert len(calls) == 2 and calls[0].half_closed and text == "<8>"
    ends = [item for message in calls[0].written for item in message.items if item.end]
    assert [item.generation_id for item in ends] == [1]


def test_a_failed_stream_fails_its_generations_and_the_next_one_opens_a_new_stream():
    async def run():
        calls = []
        shared = SharedDetokenize(lambda: calls.append(ScriptedCall(lambda message: None)) or calls[-1])
        waiting = [shared.open([], skip_special_tokens=False) for _ in range(3)]
        for generation in waiting:
            await generation.write([1])
        calls[0].fail(Unavailable())
        errors = []
        for generation in waiting:
            with pytest.raises(OpenAIError) as info:
                await generation.read()
            errors.append(info.value)
            generation.cancel()
        fresh = shared.open([], skip_special_tokens=False)
        return calls, errors, fresh

    calls, errors, fresh = asyncio.run(run())
    assert [e.status for e in errors] == [503] * 3 and "tokenizer" in errors[0].message
    assert len(calls) == 2 and calls[0].cancelled


def test_generate_many_routes_outputs_by_request_and_maps_errors_as_a_stream_status():
    def engine(message: engine_pb2.GenerateManyRequest) -> engine_pb2.GenerateManyResponse | None:
        reply = engine_pb2.GenerateManyResponse()
        for request in message.requests:
            if request.request_id == "bad":
                reply.outputs.add(request_id="bad", error=engine_pb2.RequestError(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="top_p must be in (0, 1]", param="top_p"))
            else:
                for k in range(3):
                    reply.outputs.add(request_id=request.request_id, output=engine_pb2.GenerateResponse(
                        token_ids=[k], finish_reason=engine_pb2.FINISH_REASON_LENGTH if k == 2 else 0))
        return reply if reply.outputs else None

    async def run():
        calls = []
        shared = SharedGenerate(lambda: calls.append(ScriptedCall(engine)) or calls[-1])
        a, b = shared.generate(engine_pb2.GenerateRequest(request_id="a")), \
            shared.generate(engine_pb2.GenerateRequest(request_id="b"))
        bad = shared.generate(engine_pb2.GenerateRequest(request_id="bad"))
        aborted = shared.generate(engine_pb2.GenerateRequest(request_id="c"))
        running = shared.running("a")
        tokens = {name: [t async for output in call for t in output.token_ids] for name, call in (("a", a), ("b", b))}
        with pytest.raises(OpenAIError) as info:
            await anext(bad)
        aborted.cancel()
        await asyncio.sleep(0.01)
        return calls, running, tokens, info.value, shared.running("a")

    calls, running, tokens, error, still_running = asyncio.run(run())
    assert running and not still_running
    assert tokens == {"a": [0, 1, 2], "b": [0, 1, 2]}
    assert (error.status, error.param) == (400, "top_p")
    assert [list(m.abort_request_ids) for m in calls[0].written if m.abort_request_ids] == [["c"]]
    assert len(calls) == 1 and calls[0].half_closed


def test_a_request_past_its_deadline_gets_504_and_is_aborted():
    async def run():
        calls = []
        shared = SharedGenerate(lambda: calls.append(ScriptedCall(lambda message: None)) or calls[-1], timeout_s=0.05)
        silent = shared.generate(engine_pb2.GenerateRequest(request_id="silent"))
        with pytest.raises(OpenAIError) as info:
            await anext(silent)
        await asyncio.sleep(0.01)
        return calls, info.value

    calls, error = asyncio.run(run())
    assert (error.status, error.code) == (504, "deadline_exceeded")
    assert [list(m.abort_request_ids) for m in calls[0].written if m.abort_request_ids] == [["silent"]]
    assert calls[0].half_closed
