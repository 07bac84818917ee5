"""Waiting on observable state in tests, instead of sleeping for a guessed time: poll a condition
until it holds or a deadline passes. Deadlines are generous (a loaded 2-core CI machine runs several
processes per test); a condition that holds returns at once, so a generous deadline costs nothing."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 60.0


def wait_until(condition: Callable[[], T], timeout_s: float = DEADLINE_S, what: str | Callable[[], str] = "",
               poll_s: float = 0.05) -> T:
    """``condition()``'s first truthy value, polled every ``poll_s``; an AssertionError saying ``what``
    (a string, or a function called then, e.g. for a log's tail) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s: {what() if callable(what) else what}")
        time.sleep(poll_s)


async def until(condition: Callable[[], T | Awaitable[T]], timeout_s: float = DEADLINE_S, what: str = "",
                poll_s: float = 0.01) -> T:
    """``wait_until`` inside an event loop: polls without blocking it (``condition`` may be async)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s: {what}")
        await asyncio.sleep(poll_s)
