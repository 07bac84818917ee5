"""Drain.race: a stream cancelled while it waits (its client left) leaves nothing waiting behind; past
the drain's deadline a waiting stream gets a 503 and what it waited for is cancelled."""

import asyncio

import pytest

from services.gateway.drain import Drain
from services.gateway.errors import OpenAIError


def test_cancelling_the_race_cancels_what_it_waits_for():
    async def run():
        never = asyncio.Queue()
        racing = asyncio.ensure_future(Drain().race(never.get()))
        while not never._getters:
            await asyncio.sleep(0)  # one turn of the loop, until the race waits on the queue
        racing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await racing
        await asyncio.sleep(0)
        return [g for g in never._getters if not g.cancelled()], \
            [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(run()) == ([], [])


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


def test_a_stream_waiting_at_the_deadline_gets_503_and_its_step_is_cancelled():
    async def run():
        drain = Drain()
        drain.loop = asyncio.get_running_loop()
        step = asyncio.get_running_loop().create_future()
        racing = asyncio.ensure_future(drain.race(step))
        drain.begin_threadsafe(0.01)
        with pytest.raises(OpenAIError) as info:
            await racing
        with pytest.raises(OpenAIError):  # a race that starts after the deadline fails at once
            await drain.race(asyncio.sleep(10))
        return info.value.code, step.cancelled(), racing.cancelling()

    assert asyncio.run(run()) == ("shutting_down", True, 0)
