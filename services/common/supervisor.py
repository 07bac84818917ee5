"""Child processes that are kept running: `strata up`'s services and the local autoscaler's engines.

A ``ChildProcess`` is one command whose output is read line by line (prefixed to our stdout and/or
written to a log file, the last lines kept for error messages). A ``Supervisor`` watches a set of
them from one thread: a child that dies is started again after a backoff (1 s, doubling up to
``max_backoff_s``), and is "up" again once its health check passes; one that dies
``max_failed_starts`` times in a row without passing its health check in between is crash-looping,
and the supervisor gives up: ``fatal`` names it with its exit code and the tail of its log. A child
that is *retired* (asked to stop: a drained replica) is not restarted.

Children get SIGTERM when the thread that started them dies (Linux parent-death signal), so none are
left behind: the supervisor's thread lives until ``stop()``.
"""

import collections
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1
try:  # resolved once here: the forked child only calls it (no library loading between fork and exec)
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux
    _prctl = None


def die_with_parent() -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent_batch_scheduled() -> None:  # runs in the child between fork and exec
    die_with_parent()
    _set_policy("SCHED_BATCH")  # every thread the child starts inherits it


def die_with_parent_not_batch_scheduled() -> None:  # runs in the child between fork and exec
    """As `die_with_parent`, and SCHED_OTHER where the parent runs SCHED_BATCH (an engine that a
    batch-scheduled autoscaler starts), which a fork passes on."""
    die_with_parent()
    try:
        batch = os.sched_getscheduler(0) == os.SCHED_BATCH
    except (AttributeError, OSError):
        return
    if batch:
        _set_policy("SCHED_OTHER")


def _set_policy(name: str) -> None:
    try:  # Linux
        os.sched_setscheduler(0, getattr(os, name), os.sched_param(0))
    except (AttributeError, OSError):  # elsewhere the child runs as this process does
        pass


class CrashLoopError(RuntimeError):
    """A child kept dying before it became healthy; the message names it and shows its log's tail."""


class ChildProcess:
    """One child process and the thread that reads its output."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None = None, echo: bool = True,
                 env: dict[str, str] | None = None, cpus: set[int] | None = None, prefix: bool = True,
                 batch_scheduled: bool = False) -> None:
        self.name = name
        self._prefix = f"[{name}] " if prefix else ""  # before each echoed line
        self.cpus = cpus  # CPU affinity, set right after the spawn (threads the child starts inherit it)
        # Linux's SCHED_BATCH, from its first instruction: a thread of it that wakes up does not take
        # the core from the thread running there, but waits for that one's time slice to end or for
        # it to wait (`strata up`'s services beside the engines)
        self.batch_scheduled = batch_scheduled
        self.argv = argv
        self.env = env or {}
        self.log_path = log_path
        self._echo = echo
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.starts = 0

    def spawn(self) -> None:
        # A process group of its own, so that a terminal's Ctrl-C reaches only this process (which stops
        # its children in order), but not a session of its own: Linux's autogroup scheduler shares the
        # cores between sessions first, and an engine in a session of its own got at most one core of
        # two beside one busy process of the user's session however many threads it ran (on 2 cores
        # through `strata up`, one stream, float32: tok/s fell 1.80-2.13x beside it in a session of its
        # own, 1.46-1.61x in the user's with its threads bound, cpu_kernels/core_binding.h; alone the same).
        self.process = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=die_with_parent_batch_scheduled if self.batch_scheduled else die_with_parent_not_batch_scheduled,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        if self.cpus:
            try:
                os.sched_setaffinity(self.process.pid, self.cpus)
            except OSError:  # it exited already, or the cores are not ours: it runs unpinned
                pass
        self.starts += 1

    def start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read, args=(self.process,), name=f"log-{self.name}",
                                        daemon=True)
        self._reader.start()

    def _read(self, process: subprocess.Popen) -> None:
        log_file: IO[str] | None = open(self.log_path, "a", encoding="utf-8") if self.log_path else None
        try:
            for raw in process.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self._tail.append(line)
                if log_file:
                    log_file.write(line + "\n")
                    log_file.flush()
                if self._echo:
                    print(f"{self._prefix}{line}", flush=True)
        finally:
            if log_file:
                log_file.close()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def tail(self) -> str:
        if self._reader is not None:
            self._reader.join(timeout=1.0)  # let the last lines of a dead child arrive
        return "\n".join(f"  [{self.name}] {line}" for line in self._tail) or f"  [{self.name}] (no output)"

    def describe_exit(self) -> str:
        where = f" (log: {self.log_path})" if self.log_path else ""
        return f"the {self.name} exited with code {self.exit_code}{where}; last lines of its log:\n{self.tail()}"

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def wait_or_kill(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass(frozen=True)
class ChildStatus:
    child: ChildProcess
    up: bool  # its health check passed since its last start
    retired: bool  # asked to stop for good
    started_at: float  # monotonic time of its last start


@dataclass
class _Watch:
    """What the supervisor knows of one child."""

    child: ChildProcess
    healthy: Callable[[], bool]
    up: bool = False  # its health check passed since its last start
    failed_starts: int = 0  # deaths in a row before passing the health check
    restart_at: float | None = None  # when a dead child is started again
    retired_at: float | None = None  # asked to stop for good (SIGTERM sent); killed after the grace
    spawned_at: float = 0.0


class Supervisor:
    """Keeps children running from one thread (``start()`` .. ``stop()``); see the module docstring.

    ``on_change(name, event, detail)`` is told "up", "down" (it died after being up), "restarting"
    (it died again before being up), "retired", "killed" (a retired child still running after the
    grace) and "gone" (a retired child exited), with a sentence
    of detail; it runs on the supervisor's thread and must be quick."""

    def __init__(self, initial_backoff_s: float = 1.0, max_backoff_s: float = 30.0, max_failed_starts: int = 5,
                 retire_grace_s: float = 60.0, poll_s: float = 0.2,
                 on_change: Callable[[str, str, str], None] = lambda name, event, detail: None) -> None:
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_failed_starts = max_failed_starts
        self.retire_grace_s = retire_grace_s
        self.poll_s = poll_s
        self.on_change = on_change
        self.fatal: CrashLoopError | None = None
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._failed = threading.Event()
        self._thread: threading.Thread | None = None
        self._to_spawn: list[_Watch] = []  # added while running: spawned on the supervisor's thread

    def watch(self, child: ChildProcess, healthy: Callable[[], bool], up: bool = True) -> None:
        """Supervises a child that is already running (``up``: it passed its health check)."""
        with self._lock:
            self._watches[child.name] = _Watch(child, healthy, up=up, spawned_at=time.monotonic())

    def add(self, child: ChildProcess, healthy: Callable[[], bool]) -> None:
        """Starts a new child (on the supervisor's thread, so the parent-death signal is tied to it)."""
        with self._lock:
            self._to_spawn.append(_Watch(child, healthy))

    def retire(self, name: str) -> None:
        """SIGTERM, no restart; SIGKILL if it is still alive ``retire_grace_s`` later."""
        with self._lock:
            watch = self._watches.get(name)
            if watch is None or watch.retired_at is not None:
                return
            watch.retired_at = time.monotonic()
            watch.restart_at = None
        watch.child.terminate()
        self.on_change(name, "retired", "asked to stop (SIGTERM); it finishes what it runs, then exits")

    def children(self) -> list["ChildStatus"]:
        """Every child watched, retired ones included until they exit."""
        with self._lock:
            return [ChildStatus(w.child, w.up, w.retired_at is not None, w.spawned_at) for w in self._watches.values()]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def wait_failed(self, timeout_s: float | None = None) -> bool:
        """Blocks until a child crash-loops (True) or the timeout passes (False)."""
        return self._failed.wait(timeout_s)

    def stop(self) -> None:
        """Stops watching (children are the owner's to stop)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                new, self._to_spawn = self._to_spawn, []
                for watch in new:
                    self._watches[watch.child.name] = watch
            for watch in new:
                self._spawn(watch)
            for watch in list(self._watches.values()):
                if self._stopping.is_set():
                    return
                self._tend(watch)
            self._stopping.wait(self.poll_s)

    def _spawn(self, watch: _Watch) -> None:
        watch.child.spawn()
        watch.child.start_reader()
        watch.spawned_at = time.monotonic()
        watch.up = False

    def _tend(self, watch: _Watch) -> None:
        child, now = watch.child, time.monotonic()
        code = child.exit_code
        if watch.retired_at is not None:
            if code is not None:
                with self._lock:
                    self._watches.pop(child.name, None)
                self.on_change(child.name, "gone", f"exited with code {code}")
            elif now - watch.retired_at > self.retire_grace_s:
                self.on_change(child.name, "killed", f"still running {self.retire_grace_s:.0f} s after SIGTERM")
                child.process.kill()
            return
        if code is None:
            if not watch.up and watch.healthy():
                watch.up, watch.failed_starts = True, 0
                detail = f"healthy again (start {child.starts})" if child.starts > 1 else "healthy"
                self.on_change(child.name, "up", detail)
            return
        if watch.restart_at is None:  # it just died
            was_up, watch.up = watch.up, False
            watch.failed_starts = 0 if was_up else watch.failed_starts + 1
            if watch.failed_starts >= self.max_failed_starts:
                self.fatal = CrashLoopError(f"{child.name} keeps crashing at start ({watch.failed_starts} times "
                                            f"in a row); {child.describe_exit()}")
                self._failed.set()
                self._stopping.set()
                return
            backoff = min(self.max_backoff_s, self.initial_backoff_s * 2 ** watch.failed_starts)
            watch.restart_at = now + backoff
            self.on_change(child.name, "down" if was_up else "restarting",
                           f"exited with code {code}; restarting it in {backoff:g} s")
        elif now >= watch.restart_at:
            watch.restart_at = None
            self._spawn(watch)
