"""The gateway's shared DetokenizeMany stream against a scripted call: what many requests queue during
a write goes out as one message, replies reach the request they belong to, the stream half-closes
when its last request leaves, and a failed stream fails its requests and is replaced by the next
request's. (The shared GenerateMany stream: tests/common/test_shared_generate.py.)"""

import asyncio

import pytest

from services.common.pb import tokenizer_pb2
from services.gateway.errors import OpenAIError
from services.gateway.shared_detokenize import SharedDetokenize
from tests.scripted_call import ScriptedCall, Unavailable


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
