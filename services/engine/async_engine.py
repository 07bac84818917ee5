"""The asyncio facade over `EngineCore`: the engine loop runs in its own thread, requests and
aborts reach it through a thread-safe inbox, outputs come back to per-request asyncio queues.

Contract: `generate()` validates at once (raising InvalidRequestError in the caller), then yields
the request's outputs until the one with a finish reason. Leaving the iteration early (the caller
is cancelled or closes it) aborts the request, which frees its KV blocks.
"""

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from services.common.errors import InvalidRequestError
from services.engine.engine_core import EngineCore
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import SchedulerStats
from services.engine.scheduler_output import RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncEngine:
    def __init__(self, core: EngineCore, on_step=None) -> None:
        """on_step(outputs, stats, step_seconds, num_batched_tokens) is called from the engine thread after every step
        that ran (metrics, event publishing); it must be quick."""
        self.core = core
        self._on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stats = core.stats()
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def shutdown(self) -> None:
        if self._started:
            self._inbox.put(_Stop())
            self._thread.join(timeout=30)

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's stats as of the last step; safe from any thread."""
        return self._stats

    @property
    def num_active_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        self.core.validate(prompt_token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, cache_salt))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # --- engine thread ---

    def _run(self) -> None:
        while True:
            idle = not self.core.has_unfinished_requests()
            try:
                commands = [self._inbox.get()] if idle else []
                while True:
                    commands.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if isinstance(command, _Stop):
                    self._fail_all(RuntimeError("the engine is shutting down"))
                    return
                self._apply(command)
            if not self.core.has_unfinished_requests():
                self._stats = self.core.stats()
                continue
            started = time.perf_counter()
            try:
                outputs = self.core.step()
            except Exception as exc:  # a bug or a device error: fail the batch, keep serving
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._stats = self.core.stats()
            self._deliver(outputs)
            if self._on_step is not None:
                self._on_step(outputs, self._stats, time.perf_counter() - started,
                              self.core.last_num_batched_tokens)

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            self.core.abort(command.request_id)
            return
        try:
            self.core.add_request(command.request_id, command.prompt_token_ids, command.params,
                                  command.cache_salt)
        except Exception as exc:
            self._deliver_error(command.request_id, exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for output in outputs:
                target = self._streams.get(output.request_id)
                if target is not None:
                    by_loop[target[0]].append((target[1], output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.core.abort(request_id)
            self._deliver_error(request_id, exc)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)
