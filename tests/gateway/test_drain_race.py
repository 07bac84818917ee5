"""Drain.race: a stream cancelled while it waits (its client left) leaves no task behind, which
asyncio would otherwise log as "Task was destroyed but it is pending!" when it is collected."""

import asyncio

import pytest

from services.gateway.drain import Drain
from services.gateway.errors import OpenAIError


def test_cancelling_the_race_cancels_what_it_waits_for():
    async def run():
        never = asyncio.Queue()
        racing = asyncio.ensure_future(Drain().race(never.get()))
        while not [t for t in asyncio.all_tasks() if t not in (asyncio.current_task(), racing)]:
            await asyncio.sleep(0)  # one turn of the loop, until the race waits on the step's own task
        racing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await racing
        await asyncio.sleep(0)  # the inner task's cancellation runs
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(run()) == []


def test_past_the_deadline_the_stream_ends_with_503_and_nothing_left_running():
    async def run():
        drain = Drain()
        drain.loop = asyncio.get_running_loop()
        drain.begin_threadsafe(0.01)
        with pytest.raises(OpenAIError) as info:
            await drain.race(asyncio.Queue().get())
        await asyncio.sleep(0)
        return info.value.status, [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(run()) == (503, [])


def test_a_result_before_the_deadline_is_returned():
    async def run():
        return await Drain().race(asyncio.sleep(0, result="step"))

    assert asyncio.run(run()) == "step"
