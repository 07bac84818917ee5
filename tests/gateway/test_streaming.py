"""The SSE stream the driver writes, with choices fed from a scripted source instead of upstreams:
role first, exactly one finish_reason per choice, usage chunk, [DONE], and an error after the
stream began as an error event followed by [DONE]."""

import asyncio
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from services.gateway import sse
from services.gateway.chat import ChatRenderer
from services.gateway.completions import CompletionRenderer
from services.gateway.drain import Drain
from services.gateway.errors import OpenAIError
from services.gateway.generation import Step
from services.gateway.metrics import GatewayMetrics
from services.gateway.serving import RequestContext, Usage, _EventStream, _Recorder
from services.gateway.validation import GenerationParams
from tests.common.spans import in_memory_exporter


class ScriptedChoices:
    """Pushes the given steps to a `StepSink` as FanOut does, then ends it; an exception fails it when
    reached (and cancels the rest, as FanOut does on an engine's error); an item may be a
    ``(delay_s, step)`` pair, pushed after that delay."""

    def __init__(self, items, sink):
        self.finished = False
        self.cancelled = False
        self._pushing = asyncio.ensure_future(self._push(list(items), sink))

    async def _push(self, items, sink):
        for item in items:
            if isinstance(item, tuple):
                delay, item = item
                await asyncio.sleep(delay)
            if isinstance(item, Exception):
                self.cancelled = True
                sink.fail(item)
                return
            sink.step(item)
        self.finished = True
        sink.end()

    def cancel(self):
        self.cancelled = True
        self._pushing.cancel()


def run_stream(renderer, params, steps, num_choices):
    """The SSE body an `_EventStream` writes (its headers already sent) for the scripted steps."""
    async def collect():
        ctx = RequestContext.new("test", "m")
        usage = Usage([[1, 2, 3]], params.n)
        stream = _EventStream(renderer, renderer.stream(ctx, params, usage, num_choices), usage,
                              _Recorder(GatewayMetrics(), ctx), Drain())
        stream.commit()
        source = ScriptedChoices(steps, stream)
        written = []

        async def send(message):
            written.append(message["body"])

        await asyncio.wait_for(stream.write(send), 5)
        return sse.parse(b"".join(written)), source
    return asyncio.run(collect())


def test_chat_stream_framing_with_n_and_usage():
    params = GenerationParams(n=2, stream=True, include_usage=True)
    steps = [Step(0, "Hel", [1], completion_tokens=1), Step(1, "Yo", [2], completion_tokens=1),
             Step(0, "lo", [3], finish_reason="length", completion_tokens=2),
             Step(1, "", [4], finish_reason="stop", stop_reason=4, completion_tokens=2)]
    events, _ = run_stream(ChatRenderer(None, False), params, steps, 2)
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


def test_error_after_the_stream_began_is_an_error_event_then_done():
    params = GenerationParams(stream=True)
    steps = [Step(0, "partial", [1]), OpenAIError("engine failed: UNAVAILABLE", 503)]
    events, _ = run_stream(CompletionRenderer(None, False, None, 1), params, steps, 1)
    assert events[0]["choices"][0]["text"] == "partial"
    assert events[1] == {"error": {"message": "engine failed: UNAVAILABLE",
                                   "type": "service_unavailable_error", "param": None, "code": None}}
    assert events[2:] == ["[DONE]"]


def test_an_error_after_the_stream_began_marks_the_requests_span_failed():
    """The HTTP status was 200 (the headers went out), but the request failed: its root span is an
    error, as a 5xx before the headers makes it (TracingMiddleware), so a trace search for errors
    finds a stream cut by an engine's failure; a 4xx after the headers leaves it unset, as HTTP's."""
    exporter = in_memory_exporter()
    tracer = trace.get_tracer("tests.streaming")
    for status in (503, 400):
        with tracer.start_as_current_span(f"POST /v1/completions {status}"):
            run_stream(CompletionRenderer(None, False, None, 1), GenerationParams(stream=True),
                       [Step(0, "partial", [1]), OpenAIError("engine failed: UNAVAILABLE", status)], 1)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    failed, refused = spans["POST /v1/completions 503"], spans["POST /v1/completions 400"]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "engine failed: UNAVAILABLE"
    assert failed.attributes["error.type"] == "service_unavailable_error"
    assert refused.status.status_code is StatusCode.UNSET and "error.type" not in refused.attributes


def test_a_step_whose_tokens_show_no_text_yet_still_gets_its_chunk():
    """As vLLM streams: a chunk per step with tokens, its text "" where none shows yet (a special token,
    half a UTF-8 character, a possible stop string), so a client times the first token when it comes
    (vLLM's benchmark fails a stream without a chunk); a step without tokens sends nothing."""
    params = GenerationParams(stream=True)
    steps = [Step(0, "", []), Step(0, "", [1]), Step(0, "", [2]), Step(0, "x", [3], finish_reason="length")]
    events, _ = run_stream(CompletionRenderer(None, False, None, 1), params, steps, 1)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["", "", "x"]
    events, _ = run_stream(ChatRenderer(None, False), params, steps, 1)
    assert [e["choices"][0]["delta"] for e in events[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": ""}, {"content": ""}, {"content": "x"}]


@pytest.mark.slow  # imports the gateway in a new interpreter
def test_gateway_does_not_import_torch():
    code = ("import sys, services.gateway, services.gateway.app, services.gateway.__main__, "
            "services.launcher; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
