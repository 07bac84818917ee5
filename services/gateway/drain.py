"""The gateway's drain on SIGTERM: it stops taking generation requests (503, Retry-After) and lets
the running streams finish for up to ``--shutdown-timeout``; a stream still running then ends with
an OpenAI error event and ``[DONE]``, never a cut connection. uvicorn's own graceful shutdown (it
closes the listening socket and waits for connections) is given a little longer, so those last
events go out first.
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from services.gateway.errors import OpenAIError

T = TypeVar("T")


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's, set when it starts
        self._deadline_passed: asyncio.Event | None = None

    def begin_threadsafe(self, timeout_s: float) -> None:
        """From a signal handler or any thread: drain from now for ``timeout_s``."""
        self.draining = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._begin, timeout_s)

    def _begin(self, timeout_s: float) -> None:
        if self._deadline_passed is None or not self._deadline_passed.is_set():
            asyncio.get_running_loop().call_later(timeout_s, self._deadline().set)

    def _deadline(self) -> asyncio.Event:
        if self._deadline_passed is None:
            self._deadline_passed = asyncio.Event()
        return self._deadline_passed

    async def race(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, unless the drain's deadline passes first (then OpenAIError 503).
        Cancelled (the client left mid-stream), it cancels ``awaitable`` too: a task left pending
        would be garbage-collected so ("Task was destroyed but it is pending!")."""
        task = asyncio.ensure_future(awaitable)
        deadline = asyncio.ensure_future(self._deadline().wait())
        try:
            await asyncio.wait({task, deadline}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            deadline.cancel()
            if not task.done():
                task.cancel()
        if task.done():
            return task.result()
        raise OpenAIError("The server is shutting down and this stream ran past its drain timeout "
                          "(--shutdown-timeout); the output is incomplete.", 503, code="shutting_down")
