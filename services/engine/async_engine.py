"""The asyncio facade over `EngineCore`: requests and aborts reach the engine loop through a thread-safe
inbox, outputs come back on the requests' event loop: to a queue per request that `generate()`
iterates, or to the callback each request was `submit()`ted with.

The server runs the engine loop on its event loop (`drive()`), on the process's main thread: a step
predicted to be short (`step_placement`: under 0.25 s) runs right there, between the loop's
callbacks; a longer one (a long prompt's prefill, a large model's decode on CPU) on a step thread,
while the loop goes on answering health checks. A step's outputs then reach their gRPC stream
without a thread hand-off, and the loop's work for them runs between steps instead of against them:
with the loop on a thread of its own, each token woke it (~5 context switches per token), and its
~0.2 ms of Python per token waited for the GIL the model's thread held, or took it from that thread
as it came back from its kernels. Through `strata up` on 2 cores (small model, bfloat16, one
stream, twelve alternating runs each): median TPOT 2.25 ms against 2.43 with the loop on a thread of
its own. Blocking the loop for a short step costs nothing: a step's outputs go out between steps
either way, and a request that arrives during a step joins the next one either way. `start()` runs
the loop in a background thread instead (tests, embedding).

With a `StepTracer` (`--trace-steps`), each step that ran gets a span linked to the spans of the
requests it served: `generate()` registers the request's span context, the loop hands the tracer
each step before delivering its outputs.

Contract: `generate()` validates at once (raising InvalidRequestError in the caller; ResourceExhaustedError
when --max-num-seqs + --max-waiting-requests requests are already in), then yields
the request's outputs until the one with a finish reason: the first token at once, then one output per
``--stream-interval`` tokens (as vLLM's flag: fewer messages through the stack per token; 1: every step),
and the finish. Leaving the iteration early (the caller
is cancelled or closes it) aborts the request, which frees its KV blocks. `submit()` keeps the same
contract with a callback in place of the iteration, and its handle's `cancel()` in place of leaving it.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from opentelemetry.trace import SpanContext

from services.common.errors import InvalidRequestError, ResourceExhaustedError
from services.engine.engine_core import EngineCore
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import SchedulerStats
from services.engine.scheduler_output import RequestOutput, SchedulerOutput
from services.engine.step_placement import StepPlacement
from services.engine.step_tracing import StepTracer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str
    fairness_key: str
    arrival_time: float  # time.monotonic() when generate() was called


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


@dataclass(frozen=True)
class _AbortAll:
    error: BaseException


class AsyncEngine:
    def __init__(self, core: EngineCore, on_step=None, step_tracer: StepTracer | None = None,
                 placement: StepPlacement | None = None) -> None:
        """on_step(outputs, stats, step_seconds, num_batched_tokens) is called from the engine loop after every step
        that ran (metrics, event publishing); it must be quick. ``step_tracer``: step spans (None: none made).
        ``placement``: which thread runs each step under `drive()` (by default `StepPlacement()`)."""
        self.core = core
        self._on_step = on_step
        self._step_tracer = step_tracer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stats = core.stats()
        self._started = False
        self._home: asyncio.AbstractEventLoop | None = None  # the loop drive() runs on
        self._home_thread: int | None = None
        self._wake: asyncio.Event | None = None  # set when the inbox gets a command (drive())
        self._placement = placement or StepPlacement()
        self._idle: asyncio.Event | None = None  # see wait_until_idle
        waiting = core.config.max_waiting_requests
        self.max_active = None if waiting == -1 else core.config.max_num_seqs + waiting  # admission bound
        self.stream_interval = core.config.stream_interval

    def start(self) -> None:
        """Runs the engine loop in a background thread."""
        if not self._started:
            self._started = True
            self._thread.start()

    async def drive(self) -> None:
        """Runs the engine loop on the running event loop until `shutdown()`: short steps on its thread,
        the others on a step thread of their own (see the module's docstring)."""
        self._home, self._home_thread = asyncio.get_running_loop(), threading.get_ident()
        self._wake = asyncio.Event()
        step_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        try:
            while self._apply_commands(wait=False):
                if not self.core.has_unfinished_requests():
                    self._stats = self.core.stats()
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                scheduled = self.core.schedule()
                outputs = []
                if scheduled is not None:
                    rows, tokens = len(scheduled.chunks), scheduled.num_batched_tokens
                    if self._placement.inline(rows, tokens):
                        outputs = self._run_step(scheduled)
                    else:
                        outputs = await self._home.run_in_executor(step_thread, self._run_step, scheduled)
                    self._placement.observe(rows, tokens, time.perf_counter() - started)
                step_seconds = time.perf_counter() - started
                self._deliver_step(outputs, step_seconds)
                # Two passes of the loop before the next step. In the first, the tasks the outputs woke
                # send them (and this task's turn comes before the I/O that came meanwhile is read); the
                # step's metrics follow, while the receiver already works on the outputs. In the
                # second, the tasks that I/O woke run: new requests and aborts join the next step.
                # (Metrics before the sends, as they were: through `strata up` on 2 cores, small,
                # bfloat16, median of alternating pairs, 64 streams 7.9% fewer tok/s (8 pairs), one
                # stream TPOT 6% longer (12 pairs).)
                await asyncio.sleep(0)
                self._observe_step(outputs, step_seconds)
                await asyncio.sleep(0)
        finally:
            step_thread.shutdown(wait=False)

    def shutdown(self) -> None:
        """Fails the requests still running and stops the loop; safe from any thread."""
        self._command(_Stop())
        if self._started and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def abort_all(self, error: BaseException) -> None:
        """Ends every running request with ``error`` and frees its blocks; the loop keeps going."""
        self._command(_AbortAll(error))

    def _command(self, command) -> None:
        """Queues ``command`` for the engine loop, and wakes `drive()` if it waits for one."""
        self._inbox.put(command)
        if self._home is None:
            return
        if threading.get_ident() == self._home_thread:
            self._wake.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing waits any more
                self._home.call_soon_threadsafe(self._wake.set)

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's stats as of the last step; safe from any thread."""
        return self._stats

    @property
    def num_active_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    async def wait_until_idle(self) -> None:
        """Returns once no request is active; call it on the event loop the requests run on."""
        while self.num_active_requests:
            self._idle = asyncio.Event()  # set by the last request's generate() as it ends
            await self._idle.wait()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
        fairness_key: str = "",
        span_context: SpanContext | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``span_context``: the request's span, which the step spans link to (with a step tracer)."""
        stream: asyncio.Queue = asyncio.Queue()
        self._open(request_id, prompt_token_ids, params, cache_salt, fairness_key, span_context, stream)
        gate = _StreamInterval(self.stream_interval)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                while isinstance(item, RequestOutput) and not item.finished and not stream.empty():
                    item = _merge(item, stream.get_nowait())  # a slow consumer gets fewer, bigger outputs
                item = gate.admit(item)
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._close(request_id, finished)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput | BaseException], None],
        cache_salt: str = "",
        fairness_key: str = "",
    ) -> "SubmittedRequest":
        """`generate()` for a caller that takes the outputs as they come instead of iterating them in a
        task of each request's own (GenerateMany: one callback per step delivers every request's
        outputs): ``on_output`` runs on the calling event loop with each output generate() would yield,
        up to the one with a finish reason, or with the exception it would raise instead. Validation and
        admission raise here, as generate() raises them; the handle's ``cancel()`` aborts the request."""
        submitted = SubmittedRequest(self, request_id, on_output)
        self._open(request_id, prompt_token_ids, params, cache_salt, fairness_key, None, submitted)
        return submitted

    def _open(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str,
              fairness_key: str, span_context: SpanContext | None, sink) -> None:
        """Validates and admits the request, and queues it for the engine thread; its outputs (and an
        error) go to ``sink.put_nowait`` on the calling event loop."""
        arrival_time = time.monotonic()
        self.core.validate(prompt_token_ids, params)
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            if self.max_active is not None and len(self._streams) >= self.max_active:
                raise ResourceExhaustedError(
                    f"the engine is at capacity: {len(self._streams)} requests running or waiting "
                    f"(--max-num-seqs {self.core.config.max_num_seqs} + --max-waiting-requests "
                    f"{self.core.config.max_waiting_requests}); retry later")
            self._streams[request_id] = (asyncio.get_running_loop(), sink)
        if self._step_tracer is not None and span_context is not None:
            self._step_tracer.register(request_id, span_context)
        self._command(_Add(request_id, list(prompt_token_ids), params, cache_salt, fairness_key, arrival_time))

    def _close(self, request_id: str, finished: bool) -> None:
        """The request's outputs are no longer wanted: aborted (its blocks freed) unless ``finished``."""
        with self._lock:
            self._streams.pop(request_id, None)
            idle = not self._streams
        if idle and self._idle is not None:
            self._idle.set()
        if self._step_tracer is not None:
            self._step_tracer.forget(request_id)
        if not finished:
            self._command(_Abort(request_id))

    # --- the engine loop (drive() or the background thread) ---

    def _run(self) -> None:
        while self._apply_commands(wait=not self.core.has_unfinished_requests()):
            if not self.core.has_unfinished_requests():
                self._stats = self.core.stats()
                continue
            started = time.perf_counter()
            outputs = self._step()
            self._finish_step(outputs, time.perf_counter() - started)

    def _apply_commands(self, wait: bool) -> bool:
        """Applies the commands in the inbox (waiting for one when ``wait``); False on `shutdown()`."""
        try:
            commands = [self._inbox.get()] if wait else []
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        for command in commands:
            if isinstance(command, _Stop):
                self._fail_all(RuntimeError("the engine is shutting down"))
                return False
            if isinstance(command, _AbortAll):
                self._fail_all(command.error)
                continue
            self._apply(command)
        return True

    def _step(self) -> list[RequestOutput]:
        scheduled = self.core.schedule()
        return [] if scheduled is None else self._run_step(scheduled)

    def _run_step(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        try:
            return self.core.run(scheduled)  # fails only the requests at fault (see EngineCore.step)
        except Exception as exc:  # a bug in that failure handling itself: fail them all, keep serving
            logger.exception("engine step failed")
            self._fail_all(exc)
            return []

    def _finish_step(self, outputs: list[RequestOutput], step_seconds: float) -> None:
        self._deliver_step(outputs, step_seconds)
        self._observe_step(outputs, step_seconds)

    def _deliver_step(self, outputs: list[RequestOutput], step_seconds: float) -> None:
        """The stats as of the step, its trace (while its requests' spans are still registered), and
        its outputs and failures to their requests."""
        self._stats = self.core.stats()
        if self._step_tracer is not None and self.core.last_num_batched_tokens:
            self._step_tracer.observe(self.core.scheduler.last_output, step_seconds, self._stats.num_waiting)
        for request_id, error in self.core.take_failures().items():
            self._deliver_error(request_id, error)
        self._deliver(outputs)

    def _observe_step(self, outputs: list[RequestOutput], step_seconds: float) -> None:
        """``on_step`` (metrics, KV events), after the step's outputs were delivered."""
        if self._on_step is not None:
            self._on_step(outputs, self._stats, step_seconds, self.core.last_num_batched_tokens)

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            self.core.abort(command.request_id)
            return
        try:
            self.core.add_request(command.request_id, command.prompt_token_ids, command.params,
                                  command.cache_salt, command.fairness_key, command.arrival_time, validated=True)
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
            self._run_on(loop, _put_all, items)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            self._run_on(target[0], target[1].put_nowait, exc)

    def _run_on(self, loop: asyncio.AbstractEventLoop, callback, *args) -> None:
        """``callback(*args)`` on ``loop``: at once where the caller is drive() on that loop (so that
        the tasks it wakes run before drive()'s next step), else soon, from any thread."""
        if loop is self._home and threading.get_ident() == self._home_thread:
            callback(*args)
        else:
            loop.call_soon_threadsafe(callback, *args)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.core.abort(request_id)
            self._deliver_error(request_id, exc)


class SubmittedRequest:
    """A request started with `AsyncEngine.submit`: passes its outputs on as they arrive on the event loop."""

    def __init__(self, engine: AsyncEngine, request_id: str, on_output) -> None:
        self._engine, self._request_id, self._on_output = engine, request_id, on_output
        self._gate = _StreamInterval(engine.stream_interval) if engine.stream_interval > 1 else None  # (1: all pass)
        self.done = False

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """An output or error from the engine thread (the request's sink, as generate()'s queue)."""
        if self.done:
            return
        if self._gate is not None:
            item = self._gate.admit(item)
            if item is None:
                return
        ended = isinstance(item, BaseException) or item.finish_reason is not None
        if ended:
            self.done = True
            self._engine._close(self._request_id, finished=True)
        try:
            self._on_output(item)
        except Exception as exc:  # a bug in the callback: this request ends with it, the step's others go on
            logger.exception("request %s: passing its output on failed", self._request_id)
            if not ended:
                self.cancel()
                with contextlib.suppress(Exception):
                    self._on_output(exc)

    def cancel(self) -> None:
        """Aborts the request unless it already ended; no output is passed on after this."""
        if not self.done:
            self.done = True
            self._engine._close(self._request_id, finished=False)


class _StreamInterval:
    """--stream-interval for one request: the first token at once, then an output per N tokens, and the
    last (and an error) at once; ``admit`` returns what to pass on now, or None while it holds tokens."""

    def __init__(self, interval: int) -> None:
        self._interval = interval
        self._held: RequestOutput | None = None
        self._sent_any = False

    def admit(self, item: RequestOutput | BaseException) -> RequestOutput | BaseException | None:
        if self._held is not None:
            item, self._held = _merge(self._held, item), None
        if isinstance(item, BaseException) or item.finished:
            return item
        if self._sent_any and len(item.new_token_ids) < self._interval:
            self._held = item
            return None
        self._sent_any = self._sent_any or bool(item.new_token_ids)
        return item


def _merge(earlier: RequestOutput, later: RequestOutput | BaseException) -> RequestOutput | BaseException:
    """One output carrying both steps' tokens (an error wins: the request failed)."""
    if isinstance(later, BaseException):
        return later
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               logprobs=earlier.logprobs + later.logprobs,
                               prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)
