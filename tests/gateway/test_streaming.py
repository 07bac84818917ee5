"""The SSE stream the driver writes, with choices fed from a scripted source instead of upstreams:
role first, exactly one finish_reason per choice, usage chunk, [DONE], and an error after the
stream began as an error event followed by [DONE]."""

import asyncio
import subprocess
import sys

import pytest

from services.gateway import sse
from services.gateway.chat import ChatRenderer
from services.gateway.completions import CompletionRenderer
from services.gateway.drain import Drain
from services.gateway.errors import OpenAIError
from services.gateway.generation import Step
from services.gateway.metrics import GatewayMetrics
from services.gateway.serving import RequestContext, Usage, _Recorder, _stream
from services.gateway.validation import GenerationParams


class ScriptedChoices:
    """Yields the given steps (an exception is raised when reached), like FanOut; an item may be a
    ``(delay_s, step)`` pair, yielded after that delay."""

    def __init__(self, items):
        self._items = list(items)
        self.finished = False
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            self.finished = True
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, tuple):
            delay, item = item
            await asyncio.sleep(delay)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def run_stream(renderer, params, steps, num_choices):
    async def collect():
        ctx = RequestContext.new("test", "m")
        source = ScriptedChoices(steps)
        first = asyncio.ensure_future(anext(source, None))
        usage = Usage([[1, 2, 3]], params.n)
        recorder = _Recorder(GatewayMetrics(), ctx)
        body = b"".join([part async for part in _stream(ctx, params, renderer, first, source, usage,
                                                         recorder, num_choices, Drain())])
        return sse.parse(body), source
    return asyncio.run(collect())


def test_chat_stream_framing_with_n_and_usage():
    params = GenerationParams(n=2, stream=True, include_usage=True)
    steps = [Step(0, "Hel", [1], completion_tokens=1), Step(1, "Yo", [2], completion_tokens=1),
             Step(0, "lo", [3], finish_reason="length", completion_tokens=2),
             Step(1, "", [4], finish_reason="stop", stop_reason=4, completion_tokens=2)]
    events, source = run_stream(ChatRenderer(None, False), params, steps, 2)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["prompt_tokens"] == 3
    assert all(c["usage"] is None for c in chunks)
    by_index = {0: [], 1: []}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk" and len(chunk["choices"]) == 1
        by_index[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum(c["finish_reason"] is not None for c in choices) == 1
        assert choices[-1]["finish_reason"] is not None
    assert "".join(c["delta"].get("content", "") for c in by_index[0]) == "Hello"
    assert by_index[1][-1]["stop_reason"] == 4
    assert source.cancelled  # cleanup always cancels what is left upstream


def test_error_after_the_stream_began_is_an_error_event_then_done():
    params = GenerationParams(stream=True)
    steps = [Step(0, "partial", [1]), OpenAIError("engine failed: UNAVAILABLE", 503)]
    events, source = run_stream(CompletionRenderer(None, False, None, 1), params, steps, 1)
    assert events[0]["choices"][0]["text"] == "partial"
    assert events[1] == {"error": {"message": "engine failed: UNAVAILABLE",
                                   "type": "service_unavailable_error", "param": None, "code": None}}
    assert events[2:] == ["[DONE]"]
    assert source.cancelled


def test_empty_steps_send_no_chunk():
    params = GenerationParams(stream=True)
    steps = [Step(0, "", [1]), Step(0, "", [2]), Step(0, "x", [3], finish_reason="length")]
    events, _ = run_stream(CompletionRenderer(None, False, None, 1), params, steps, 1)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x"]


@pytest.mark.slow  # imports the gateway in a new interpreter
def test_gateway_does_not_import_torch():
    code = ("import sys, services.gateway, services.gateway.app, services.gateway.__main__, "
            "services.launcher; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
