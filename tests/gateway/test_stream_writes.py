"""The gateway's SSE responses (`serving._ChoiceStream` of an `serving._EventStream`): a step's events
are rendered as its outputs are read, for every stream the engine's reply woke, and written after;
a client that leaves ends its stream quietly, and the response's cleanup runs however it ends."""

import asyncio

from services.gateway.completions import CompletionRenderer
from services.gateway.drain import Drain
from services.gateway.errors import OpenAIError
from services.gateway.generation import Step
from services.gateway.metrics import GatewayMetrics
from services.gateway.serving import RequestContext, Usage, _ChoiceStream, _EventStream, _Recorder


class TextEvents:
    """A stream's events: ``data: <the step's text>`` per step (logged as rendered when ``log`` is given)."""

    def __init__(self, log: list | None = None, name: str = "") -> None:
        self._log, self._name = log, name

    def opening(self) -> list[bytes]:
        return []

    def step(self, step: Step) -> list[bytes]:
        if self._log is not None:
            self._log.append(("rendered", self._name, step.text))
        return [f"data: {step.text}\n\n".encode()]

    def closing(self) -> list[bytes]:
        return []


def event_stream(events: TextEvents) -> _EventStream:
    """An `_EventStream` whose headers went out."""
    ctx = RequestContext.new("test", "m")
    usage = Usage([[1, 2, 3]], 1)
    stream = _EventStream(CompletionRenderer(None, False, None, 1), events, usage,
                          _Recorder(GatewayMetrics(), ctx), Drain())
    stream.commit()
    return stream


async def push_steps(stream: _EventStream, texts: list[str], interval_s: float) -> None:
    """A step of each text, one every ``interval_s``, then the end."""
    for i, text in enumerate(texts):
        await asyncio.sleep(interval_s)
        stream.step(Step(0, text, [i]))
    stream.end()


def test_streams_woken_together_render_before_they_write():
    log = []

    async def main():
        streams = {name: event_stream(TextEvents(log, name)) for name in "ab"}

        async def send(message):
            if message["type"] == "http.response.body" and message["more_body"]:
                log.append(("sent", message["body"].decode()[6:8]))

        async def receive():
            await asyncio.Event().wait()  # the client stays

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        responses = [asyncio.create_task(_ChoiceStream(stream, lambda: None)(scope, receive, send))
                     for stream in streams.values()]
        for i in range(2):  # an engine reply: one step's outputs of both requests, read together
            await asyncio.sleep(0.01)
            for name, stream in streams.items():
                stream.step(Step(0, f"{name}{i}", [i]))
        for stream in streams.values():
            stream.end()
        await asyncio.wait_for(asyncio.gather(*responses), 5)

    asyncio.run(main())
    assert log == [("rendered", "a", "a0"), ("rendered", "b", "b0"), ("sent", "a0"), ("sent", "b0"),
                   ("rendered", "a", "a1"), ("rendered", "b", "b1"), ("sent", "a1"), ("sent", "b1")]


def test_events_pending_together_leave_in_one_write():
    async def main():
        stream = event_stream(TextEvents())
        for text in ("x", "y"):  # (two choices' steps of one reply)
            stream.step(Step(0, text, [1]))
        stream.end()
        writes = []

        async def send(message):
            writes.append(message["body"])

        await stream.write(send)
        return writes

    assert asyncio.run(main()) == [b"data: x\n\ndata: y\n\n"]


def test_a_write_that_waits_for_a_slow_client_holds_the_later_events_back_in_order():
    async def main():
        stream = event_stream(TextEvents())
        writable = asyncio.Event()
        writable.set()
        writes = []

        async def send(message):
            if message["type"] == "http.response.body" and message["body"]:
                writes.append(message["body"].decode())
                if len(writes) == 2:  # the client's window is full: this write waits 50 ms
                    writable.clear()
                    asyncio.get_running_loop().call_later(0.05, writable.set)
            await writable.wait()

        async def receive():
            await asyncio.Event().wait()

        response = asyncio.create_task(_ChoiceStream(stream, lambda: None)({"type": "http"}, receive, send))
        await push_steps(stream, [str(i) for i in range(6)], 0.01)
        await asyncio.wait_for(response, 5)
        return writes

    writes = asyncio.run(main())
    assert "".join(writes) == "".join(f"data: {i}\n\n" for i in range(6))
    assert len(writes) < 6  # what came while a write waited left together after it


def test_a_client_that_leaves_while_a_write_waits_ends_the_stream_and_the_write():
    write_ended, closed = [], []

    async def main():
        stream = event_stream(TextEvents())
        left = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body" and message["body"]:
                try:
                    await asyncio.Event().wait()  # the client's window stays full
                finally:
                    write_ended.append(True)

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        response = asyncio.create_task(_ChoiceStream(stream, lambda: closed.append(True))({"type": "http"}, receive, send))
        await asyncio.sleep(0.01)
        stream.step(Step(0, "x", [1]))  # its write waits
        await asyncio.sleep(0.01)
        left.set()
        await asyncio.wait_for(response, 5)

    asyncio.run(main())
    assert write_ended == [True] and closed == [True]


def test_a_stream_whose_error_cannot_be_rendered_still_ends():
    class Unrenderable(CompletionRenderer):
        def error_events(self, error):
            raise KeyError("a rendering bug")

    async def main():
        ctx = RequestContext.new("test", "m")
        usage = Usage([[1, 2, 3]], 1)
        stream = _EventStream(Unrenderable(None, False, None, 1), TextEvents(), usage,
                              _Recorder(GatewayMetrics(), ctx), Drain())
        stream.commit()
        writes = []

        async def send(message):
            writes.append(message["body"])

        writing = asyncio.create_task(stream.write(send))
        stream.step(Step(0, "x", [1]))
        await asyncio.sleep(0.01)  # written; the writer waits for more
        try:
            stream.fail(OpenAIError("engine failed: UNAVAILABLE", 503))
        except KeyError:
            pass  # (FanOut logs it)
        await asyncio.wait_for(writing, 5)  # not a hung stream
        return writes

    assert asyncio.run(main()) == [b"data: x\n\n"]


def run_stream(num_events: int, client_leaves_after: int | None):
    """A `_ChoiceStream` of ``num_events`` events, one every 10 ms, to a client that leaves after
    that many events (None: stays); what the client got and whether on_close ran."""
    got, closed = [], []

    async def main():
        left = asyncio.Event()
        stream = event_stream(TextEvents())
        pushing = asyncio.create_task(push_steps(stream, [str(i) for i in range(num_events)], 0.01))

        async def send(message):
            if message["type"] == "http.response.body" and message["body"]:
                got.append(message["body"].decode())
                if client_leaves_after is not None and len(got) == client_leaves_after:
                    left.set()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        await asyncio.wait_for(_ChoiceStream(stream, lambda: closed.append(True))({"type": "http"}, receive, send), 5)
        pushing.cancel()

    asyncio.run(main())
    return got, closed


def test_a_client_that_leaves_ends_the_stream_quietly():
    got, closed = run_stream(100, client_leaves_after=3)
    assert got == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]  # nothing after it left, and no error
    assert closed == [True]


def test_a_stream_runs_to_its_end_and_closes_once():
    got, closed = run_stream(3, client_leaves_after=None)
    assert got == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert closed == [True]


def test_a_cancellation_from_elsewhere_still_cancels():
    closed = []

    async def main():
        async def send(message):
            pass

        async def receive():
            await asyncio.Event().wait()

        response = _ChoiceStream(event_stream(TextEvents()), lambda: closed.append(True))  # no event comes
        task = asyncio.create_task(response({"type": "http"}, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    assert asyncio.run(main()) == "cancelled"
    assert closed == [True]
