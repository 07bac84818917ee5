"""`generation.FanOut`: a request's choices pushed to its sink as their outputs are read, over a real
`SharedGenerate` (a scripted GenerateMany call) and over Generate calls of their own. A stop string
ends its choice and aborts it in the engine; an error fails the request once and cancels its other
choices; a sink that raises (a bug in rendering) fails only its own request, never the stream that
other requests share."""

import asyncio

import pytest
from opentelemetry import trace
from tokenizers import Tokenizer, decoders, models

from services.common.pb import engine_pb2
from services.common.shared_generate import SharedGenerate
from services.common.token_decoder import TokenDecoder
from services.gateway.errors import OpenAIError
from services.gateway.generation import FanOut, Step, plan_choices
from services.gateway.validation import GenerationParams
from tests.scripted_call import ScriptedCall

LETTERS = "abcdefgh"  # token i is LETTERS[i]


def letters_decoder() -> TokenDecoder:
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(LETTERS)}, unk_token="a"))
    tokenizer.decoder = decoders.Fuse()
    return TokenDecoder(tokenizer, frozenset(), frozenset())


def outputs(token_ids: list[int]) -> list[engine_pb2.GenerateResponse]:
    """One output per token, the last with finish reason length."""
    return [engine_pb2.GenerateResponse(token_ids=[t], finish_reason=engine_pb2.FINISH_REASON_LENGTH
                                        if k == len(token_ids) - 1 else 0) for k, t in enumerate(token_ids)]


def generate_many(message: engine_pb2.GenerateManyRequest) -> engine_pb2.GenerateManyResponse | None:
    """Every request gets "abcdef", all in one reply, as the engine sends it: the first and last tokens
    as outputs with their usage (1 prompt token, 1 of them cached), the others as next_token entries."""
    reply = engine_pb2.GenerateManyResponse()
    for request in message.requests:
        for k, output in enumerate(outputs([0, 1, 2, 3, 4, 5])):
            if 0 < k < 5:
                reply.outputs.add(request_id=request.request_id, next_token=output.token_ids[0])
                continue
            output.usage.prompt_tokens, output.usage.completion_tokens, output.usage.cached_prompt_tokens = 1, k + 1, 1
            reply.outputs.add(request_id=request.request_id, output=output)
    return reply if reply.outputs else None


class OwnCall:
    """A Generate call of its own: ``items`` (outputs, or an exception raised when reached)."""

    def __init__(self, items) -> None:
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0.001)
        if self.cancelled or not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Upstream:
    def __init__(self, calls=None) -> None:
        self.decoder = letters_decoder()
        self.shared_calls = []
        self._shared = SharedGenerate(lambda: self.shared_calls.append(ScriptedCall(generate_many)) or self.shared_calls[-1])
        self._own = calls  # by request id, or None: every request on the shared stream

    def generate(self, request):
        return self._shared.generate(request) if self._own is None else self._own[request.request_id]


class Sink:
    def __init__(self, fail_on_text: str | None = None, failing_fails: bool = False) -> None:
        self.steps: list[Step] = []
        self.errors: list[OpenAIError] = []
        self.ended = 0
        self.done = asyncio.Event()
        self._fail_on_text = fail_on_text
        self._failing_fails = failing_fails  # its fail() raises too

    def step(self, step: Step) -> None:
        if step.text == self._fail_on_text:
            raise KeyError("a rendering bug")
        self.steps.append(step)

    def end(self) -> None:
        self.ended += 1
        self.done.set()

    def fail(self, error: OpenAIError) -> None:
        self.errors.append(error)
        self.done.set()
        if self._failing_fails:
            raise KeyError("a bug in rendering the error")


def start(upstream: Upstream, params: GenerationParams, sink: Sink, request_id: str = "r") -> FanOut:
    specs = plan_choices(request_id, [[0]], [16], params)
    return FanOut(upstream, specs, params, frozenset(), sink, trace.get_current_span())


def test_steps_carry_each_output_text_and_the_running_usage():
    async def run():
        sink = Sink()
        start(Upstream(), GenerationParams(), sink)
        await asyncio.wait_for(sink.done.wait(), 5)
        return sink

    sink = asyncio.run(run())
    assert [(s.text, s.token_ids, s.completion_tokens, s.prompt_tokens, s.cached_tokens) for s in sink.steps] == [
        (LETTERS[k], [k], k + 1, 1, 1) for k in range(6)]
    assert sink.steps[-1].finish_reason == "length" and sink.ended == 1


def test_a_stop_string_ends_the_choice_and_aborts_it_in_the_engine():
    async def run():
        upstream = Upstream()
        sink = Sink()
        fanout = start(upstream, GenerationParams(stop=["cd"]), sink)
        await asyncio.wait_for(sink.done.wait(), 5)
        await asyncio.sleep(0.01)
        return upstream, sink, fanout

    upstream, sink, fanout = asyncio.run(run())
    assert "".join(step.text for step in sink.steps) == "ab"
    assert (sink.steps[-1].finish_reason, sink.steps[-1].stop_reason) == ("stop", "cd")
    assert sink.ended == 1 and not sink.errors and fanout.finished
    assert [list(m.abort_request_ids) for m in upstream.shared_calls[0].written if m.abort_request_ids] == [["r-0"]]


@pytest.mark.parametrize("failing_fails", [False, True])
def test_a_sink_that_raises_fails_its_request_alone(failing_fails):
    async def run():
        upstream = Upstream()
        broken, other = Sink(fail_on_text="c", failing_fails=failing_fails), Sink()
        start(upstream, GenerationParams(), broken, "broken")
        start(upstream, GenerationParams(), other, "other")
        await asyncio.wait_for(asyncio.gather(broken.done.wait(), other.done.wait()), 5)
        return broken, other

    broken, other = asyncio.run(run())
    assert [e.status for e in broken.errors] == [500] and "KeyError" in broken.errors[0].message
    assert not broken.ended and "".join(s.text for s in broken.steps) == "ab"
    assert "".join(s.text for s in other.steps) == "abcdef" and other.ended == 1 and not other.errors


@pytest.mark.parametrize("failing", [False, True])
def test_choices_on_calls_of_their_own_end_once_or_fail_once(failing):
    async def run():
        second = [OpenAIError("engine failed: UNAVAILABLE", 503)] if failing else outputs([2, 3])
        calls = {"r-0": OwnCall(outputs([0, 1, 2, 3])), "r-1": OwnCall(second)}
        sink = Sink()
        fanout = start(Upstream(calls), GenerationParams(n=2), sink)
        await asyncio.wait_for(sink.done.wait(), 5)
        await asyncio.sleep(0.02)  # nothing more arrives
        return calls, sink, fanout

    calls, sink, fanout = asyncio.run(run())
    if failing:
        assert [e.status for e in sink.errors] == [503] and not sink.ended and not fanout.finished
        assert calls["r-0"].cancelled  # the other choice stops
    else:
        assert sink.ended == 1 and not sink.errors and fanout.finished
        texts = {i: "".join(s.text for s in sink.steps if s.index == i) for i in (0, 1)}
        assert texts == {0: "abcd", 1: "cd"}
        assert [s.finish_reason for s in sink.steps].count("length") == 2


def test_a_generate_call_that_ends_without_a_finish_is_a_502():
    async def run():
        sink = Sink()
        start(Upstream({"r-0": OwnCall(outputs([0, 1])[:1])}), GenerationParams(), sink)
        await asyncio.wait_for(sink.done.wait(), 5)
        return sink

    sink = asyncio.run(run())
    assert [e.status for e in sink.errors] == [502]
