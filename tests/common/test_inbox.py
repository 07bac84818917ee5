"""The one-reader queue of the per-token paths (services/common/inbox.py): items come out in order,
a reader waits for the next put, a cancelled wait takes nothing and leaves the inbox usable."""

import asyncio

import pytest

from services.common.inbox import Inbox


def test_items_come_out_in_order_and_a_reader_waits_for_the_next_put():
    async def run():
        inbox = Inbox()
        inbox.put(1)
        inbox.put(2)
        assert not inbox.empty()
        assert [await inbox.get(), await inbox.get()] == [1, 2]
        assert inbox.empty()
        reader = asyncio.create_task(inbox.get())
        await asyncio.sleep(0)
        assert not reader.done()  # nothing to take yet
        inbox.put(3)
        inbox.put(4)  # a second put before the reader ran stays queued
        assert await reader == 3
        assert await inbox.get() == 4

    asyncio.run(run())


def test_a_cancelled_wait_takes_nothing_and_the_inbox_goes_on():
    async def run():
        inbox = Inbox()
        reader = asyncio.create_task(inbox.get())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        inbox.put("kept")
        assert await asyncio.wait_for(inbox.get(), 1) == "kept"
        # a put whose wake-up lands on a reader cancelled in the same turn: the item stays
        reader = asyncio.create_task(inbox.get())
        await asyncio.sleep(0)
        inbox.put("again")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert await asyncio.wait_for(inbox.get(), 1) == "again"

    asyncio.run(run())
