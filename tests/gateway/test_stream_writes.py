"""The gateway's SSE responses write a step's events together: the streams that one engine step
woke render their events first, then write them (`serving._ChoiceStream`)."""

import asyncio

from services.gateway.serving import _ChoiceStream


def test_streams_woken_together_render_before_they_write():
    log = []

    async def main():
        steps = [asyncio.Event(), asyncio.Event()]  # engine steps' outputs: each wakes every stream at once

        def response(name: str) -> _ChoiceStream:
            async def body():
                for i in range(2):
                    await steps[i].wait()
                    log.append(("rendered", name, i))
                    yield f"data: {name}{i}\n\n".encode()
            return _ChoiceStream(body(), lambda: None)

        async def send(message):
            if message["type"] == "http.response.body" and message["more_body"]:
                log.append(("sent", message["body"].decode()[6:8]))

        async def receive():
            await asyncio.Event().wait()  # the client stays

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        streams = [asyncio.create_task(response(name)(scope, receive, send)) for name in "ab"]
        for step in steps:
            await asyncio.sleep(0.01)
            step.set()
        await asyncio.wait_for(asyncio.gather(*streams), 5)

    asyncio.run(main())
    assert log == [("rendered", "a", 0), ("rendered", "b", 0), ("sent", "a0"), ("sent", "b0"),
                   ("rendered", "a", 1), ("rendered", "b", 1), ("sent", "a1"), ("sent", "b1")]


def run_stream(body_events: int, client_leaves_after: int | None):
    """A `_ChoiceStream` of ``body_events`` events, one every 10 ms, to a client that leaves after
    that many events (None: stays); what the client got, whether on_close ran, and whether the
    body's own cleanup ran."""
    got, closed, body_closed = [], [], []

    async def main():
        left = asyncio.Event()

        async def body():
            try:
                for i in range(body_events):
                    await asyncio.sleep(0.01)
                    yield f"data: {i}\n\n".encode()
            finally:
                body_closed.append(True)

        async def send(message):
            if message["type"] == "http.response.body" and message["body"]:
                got.append(message["body"].decode())
                if client_leaves_after is not None and len(got) == client_leaves_after:
                    left.set()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        await asyncio.wait_for(_ChoiceStream(body(), lambda: closed.append(True))({"type": "http"}, receive, send), 5)

    asyncio.run(main())
    return got, closed, body_closed


def test_a_client_that_leaves_ends_the_stream_quietly():
    got, closed, body_closed = run_stream(100, client_leaves_after=3)
    assert got == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]  # nothing after it left, and no error
    assert closed == [True] and body_closed == [True]


def test_a_stream_runs_to_its_end_and_closes_once():
    got, closed, body_closed = run_stream(3, client_leaves_after=None)
    assert got == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert closed == [True] and body_closed == [True]


def test_a_cancellation_from_elsewhere_still_cancels():
    closed = []

    async def main():
        async def body():
            await asyncio.sleep(10)
            yield b"data: never\n\n"

        async def send(message):
            pass

        async def receive():
            await asyncio.Event().wait()

        task = asyncio.create_task(_ChoiceStream(body(), lambda: closed.append(True))({"type": "http"}, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    assert asyncio.run(main()) == "cancelled"
    assert closed == [True]
