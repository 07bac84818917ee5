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
