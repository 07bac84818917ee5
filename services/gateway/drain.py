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
        self._deadline_passed = False
        self._racing: set[asyncio.Task] = set()  # tasks in race() now
        self._cut: set[asyncio.Task] = set()  # of those, the ones the deadline cancelled

    def begin_threadsafe(self, timeout_s: float) -> None:
        """From a signal handler or any thread: drain from now for ``timeout_s``."""
        self.draining = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._begin, timeout_s)

    def _begin(self, timeout_s: float) -> None:
        if not self._deadline_passed:
            asyncio.get_running_loop().call_later(timeout_s, self._pass_deadline)

    def _pass_deadline(self) -> None:
        self._deadline_passed = True
        for task in self._racing:
            self._cut.add(task)
            task.cancel()

    async def race(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, unless the drain's deadline passes first (then OpenAIError 503,
        ``awaitable`` cancelled). Awaited in the caller's own task, with nothing made per call: a
        stream awaits its every step so. The deadline cancels the tasks racing then, and each turns
        its cancellation into the 503; a cancellation from elsewhere (the client left) stays one."""
        task = asyncio.current_task()
        if self._deadline_passed:
            asyncio.ensure_future(awaitable).cancel()
            raise _past_deadline()
        self._racing.add(task)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            self._cut.discard(task)
            task.uncancel()
            raise _past_deadline() from None
        finally:
            self._racing.discard(task)


def _past_deadline() -> OpenAIError:
    return OpenAIError("The server is shutting down and this stream ran past its drain timeout "
                       "(--shutdown-timeout); the output is incomplete.", 503, code="shutting_down")
