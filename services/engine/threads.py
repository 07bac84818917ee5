"""The engine's CPU threads: how many run the model's kernels, and how OpenMP's idle ones wait.

Both are set where an engine process starts (`strata engine`, `strata generate`, `strata bench`, and
`python -m` of `services.engine` and `services.bench`), and by the launcher for its engine children:

- The wait policy goes into the environment before torch is imported: GNU libgomp (torch's OpenMP)
  reads it once, when it loads. libgomp's own default spins an idle thread ~300,000 times (a few
  milliseconds) before it sleeps, so between the many small parallel regions of a decode step the
  threads never sleep. On an idle machine that saves a wake-up per region; on a core shared with
  another busy process the spinning threads burn the time slices that the thread holding the work
  needs, and a step takes 10-20x longer. `GOMP_SPINCOUNT` caps the spin at about 0.16 ms, counted
  for this CPU; a user's own `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is left as it is.
- The thread count: `--num-threads`, else `OMP_NUM_THREADS` when set, else the cores this process
  may run on (its CPU affinity, which `taskset`, cgroups' cpusets and container limits narrow).
- Where the threads run: while a step runs on two threads or more, one on each of the cores this
  process may use (`binding_cores`, `cpu_kernels/core_binding.h`), where the engine's threads may fill
  them all; `--no-bind-threads` leaves them to the OS, as does a user's own OpenMP binding.
"""

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

# How long an idle OpenMP thread spins before it sleeps. libgomp counts spins (GOMP_SPINCOUNT), and
# one spin (a load and a PAUSE) takes ~160 ns on the 2-vCPU Zen 4 VM this was first tuned on but
# ~12 ns on a 2-vCPU Xeon with AMX, so the count is worked out from this time on each CPU
# (`openmp_spin_count`). On the Zen 4, libgomp's 300,000 spins took ~50 ms, longer than a small
# model's whole step; ~0.16 ms (1,000 spins there) bridges the gaps between the parallel regions of
# one step and lets the core go soon after it. Measured there, one stream through `strata up` on the
# tiny model: the engine used 18-20 ms of CPU per token at 10,000 spins, 9-14 at 1,000, 9-11 at 0
# (passive); the small shape's bfloat16 batch-1 decode step (two threads) took 7.7 ms at 1,000 spins
# and 5.1 ms at 10,000 alone, but 9.7 ms and 27.6 ms beside one busy process. On the Xeon, where
# 1,000 spins last only 12 us, the engine in-process at batch 1 (small shape, the thread governor on)
# took 4.09 ms per token in float32 and 2.38 in bfloat16 at 1,000 spins, 3.55 and 1.68 at 10,000;
# beside one busy process 8.23 and 2.62 at 1,000, 7.05 and 2.66 at 10,000, 10.87 and 2.99 at 100,000.
OPENMP_SPIN_SECONDS = 160e-6
FALLBACK_SPIN_COUNT = 1_000  # where a spin cannot be timed (no C++ compiler): the Zen 4's count
_SPIN_COUNT_RANGE = (100, 1_000_000)
_WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@functools.cache
def openmp_spin_count() -> int:
    """The GOMP_SPINCOUNT that spins for about ``OPENMP_SPIN_SECONDS`` on this CPU (two significant
    digits), timed once per process on a copy of libgomp's wait loop (``cpu_kernels/spin.cpp``, a
    few milliseconds); ``FALLBACK_SPIN_COUNT`` where that cannot be built."""
    from services.engine.cpu_kernels.build import load_function

    spin_seconds = load_function("spin.cpp", "strata_spin_seconds", [ctypes.c_int64], ctypes.c_double)
    if spin_seconds is None:
        return FALLBACK_SPIN_COUNT
    probe = 20_000
    return spin_count_for(min(spin_seconds(probe) for _ in range(5)) / probe)


def spin_count_for(seconds_per_spin: float) -> int:
    """The spins that last about ``OPENMP_SPIN_SECONDS`` at ``seconds_per_spin`` each, to two
    significant digits, within 100 and 1,000,000."""
    count = float(f"{OPENMP_SPIN_SECONDS / max(seconds_per_spin, 1e-12):.2g}")
    return int(min(max(count, _SPIN_COUNT_RANGE[0]), _SPIN_COUNT_RANGE[1]))


def openmp_wait_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for the engine's wait policy: none when it already
    names one."""
    if any(name in environ for name in _WAIT_POLICY_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": str(openmp_spin_count())}


def use_openmp_wait_policy() -> None:
    """Puts the engine's wait policy into this process's environment. Call it before torch is
    imported: libgomp ignores later changes."""
    os.environ.update(openmp_wait_env(os.environ))


def openmp_wait_description() -> str:
    """The wait policy in this process's environment, for its log."""
    named = [f"{name}={os.environ[name]}" for name in _WAIT_POLICY_VARIABLES if name in os.environ]
    return " ".join(named) or "libgomp's default"


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def resolve_num_threads(num_threads: int | None, environ: Mapping[str, str]) -> int:
    """``num_threads`` (--num-threads) when given, else a valid ``OMP_NUM_THREADS``, else the
    usable cores."""
    if num_threads is not None:
        return num_threads
    from_env = environ.get("OMP_NUM_THREADS", "").strip()
    if from_env.isdigit() and int(from_env) > 0:
        return int(from_env)
    return usable_cores()


# OpenMP's own thread binding: where the user asks for it, the engine binds nothing itself.
OPENMP_BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")


def binding_cores(bind: bool, num_threads: int | None, environ: Mapping[str, str]) -> tuple[int, ...]:
    """The cores the kernel threads of a step bind to, thread i to the i-th (while a step runs on two
    or more): the usable cores in order, where ``bind`` (--bind-threads) and the engine's threads may fill
    them all (``resolve_num_threads`` is their number: the default, or a count equal to it), and the
    environment names no OpenMP binding of its own. Else none, and the OS places the threads.

    Only an engine that owns its cores binds: a container whose affinity is a whole machine's cores but
    that runs, say, ``--num-threads 4`` leaves its threads free, or every such engine on the machine
    would bind its threads to the same first four cores."""
    if not bind or any(name in environ for name in OPENMP_BINDING_VARIABLES):
        return ()
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return ()
    return cores if len(cores) >= 2 and resolve_num_threads(num_threads, environ) == len(cores) else ()


def set_num_threads(num_threads: int | None) -> int:
    """Sets torch's intra-op thread count (see `resolve_num_threads`); returns it. Call it from the
    thread that will run the model's steps, before the first one."""
    import torch

    resolved = resolve_num_threads(num_threads, os.environ)
    torch.set_num_threads(resolved)
    return resolved



class ThreadGovernor:
    """The engine's kernel threads, sized by the cores they get and by trying: now and then one thread
    fewer (or more) for a few decode steps, kept when it decodes faster.

    A decode step is a chain of phases, and a thread that loses its core in the middle of a work item
    holds the others at that phase's end until they take its items over (after 0.1 ms, work_split.h),
    and at the step's end. When other processes need the same cores, a step on as many
    threads as cores can get slower than one on fewer; when nobody else needs them, every core helps.
    Which case holds depends on the load, not on the machine (measured on 2 cores through ``strata up``
    beside one busy process: 64 streams of short cached prompts decoded faster on one thread, 4540
    rows/s against 3940, 64 streams of 64-512-token prompts on two, 2280 against 2150; alone, one
    stream and 64 on two), so the governor measures it. It times decode steps in windows of
    ``window_steps`` steps and ``window_seconds`` of them at least (a few short steps catch a
    neighbour's bursts: see `after_step`); when a probe is due, the last window is the baseline and
    the next runs at a neighbouring size, which is kept when its decode rate (rows per second of
    decode steps) is ``min_gain`` better at about the same batch size (``_judge``), else the size
    goes back. A probe is due every ``probe_every_s``, after ``retry_s`` when the batch size changed
    during the last one, and at once when a window shows a batch 1.5 times larger or smaller than the
    one the last probe kept, or the same batch decoding more than 25% slower or 33% faster (a
    neighbour came or went).
    Between 1 and ``ceiling``.

    A probe down to fewer threads runs only while the cores are contended: while this process's
    threads spent at least ``CONTENDED_SHARE`` of their runnable time waiting for a core
    (``process_core_wait``, from /proc; always where that is unknown). Alone on its cores an engine
    decodes fastest on all of them, and a probe there only costs: 16 steps of 64 rows on one thread of
    two ran about half as fast, and the probes that each change of batch size started took 15-20% of
    an in-process run of 64 prompts on 2 cores. The share, and the cores below, are measured over every
    ``window_seconds`` of steps (prefills too) and over each trial, which lasts that long at least: at
    one stream 16 decode steps last ~30 ms, and over so few the share crossed a third now and then
    through ``strata up`` alone, where a probe then put the engine on one thread.

    Where the cores are contended and the process got three quarters of a core or more fewer than its
    team (``cores_got``: the CPU seconds its threads ran per second of steps; ``WHOLE_CORE_SHORT``),
    the team shrinks to the cores it got at once, without a probe, and a probe up to more threads is
    judged lost while they would get no more. Where half a core or more of the usable ones sat idle
    in the last measure (``usable_cores_idle``), a team below the ceiling tries one thread more at
    once: the cores' takers left. A probe needs two windows of comparable batches, which a ramping
    load (64 streams starting) does not give for many seconds: beside one busy process on 2 cores through
    ``strata up``, the engine got 0.85-0.99 cores on two threads (waiting 44-50% of the time; alone:
    1.5-1.8 cores, waiting 4-20%), and the probes moved decode steps to one thread 8-36 s into runs of
    ~30 s; measuring the cores moved every step there within a few seconds.

    A team whose threads are bound one per core (``bound``: ``binding_cores``) is never sized by the
    cores it got, only by probes: bound, a thread that shares its core with a neighbour still does its
    share of the items while it runs: beside one busy process of the same session, two bound threads got
    1.1-1.25 cores through `strata up` and decoded faster than one (the small shape's float32 batch-1
    step in-process on 2 cores: 3.4-4.0 ms against 4.8-5.3); beside one of another session, which
    Linux's autogroup scheduler gives a core of its own, they got 1.0-1.2 cores and one thread decoded
    faster (4.9-5.3 ms against 5.5-6.3). The probes tell them apart; the cores got do not.

    Every step runs on the governed team, prefills included: fewer threads than cores means their
    cores were taken, and a prefill's matrix products (oneDNN splits them evenly between the threads)
    wait for a thread that lost its core as a decode step does. The one exception is a step that runs
    a compiled graph, which runs on the team it was compiled for (``compiled_forward``: another count
    would compile it again). Called by the thread that runs the
    step (OpenMP's team size is per thread, and each thread's is set before its first step):
    ``before_step`` and ``after_step`` around every step.
    """

    def __init__(self, ceiling: int, probe_every_s: float = 10.0, window_steps: int = 16,
                 min_gain: float = 0.05, retry_s: float = 0.5, window_seconds: float = 0.5, clock=None,
                 set_threads=None, core_wait=None, core_idle=None, bound: bool = False) -> None:
        import time

        self.ceiling = self.threads = ceiling
        self.bound = bound  # threads bound one per core: sized by probes only
        self._core_wait = core_wait or process_core_wait
        self._last_core_wait = self._core_wait()
        self._core_idle = core_idle or usable_cores_idle
        self._last_core_idle = self._core_idle()
        self.idle_cores: float | None = None  # the usable cores left idle in the last measure; None: not known
        self._idle_trial_after = 0.0  # when idle cores may start a trial up again
        self._idle_measured_at = 0  # the team's size at the last measure of the idle cores
        self._short_now = False  # short of cores in the last measure
        self.contended_share: float | None = None  # of the last measure; None: not known here
        self.cores_got: float | None = None  # in the last measure; None: not known here
        self._applied = threading.local()  # the team size set last, per thread (OpenMP's is per thread)
        self._applied.threads = ceiling  # the creating thread's: set_num_threads set it
        self.probe_every_s, self.window_steps, self.min_gain = probe_every_s, window_steps, min_gain
        self.retry_s, self.window_seconds = retry_s, window_seconds
        self._clock = clock or time.monotonic
        self._set_threads = set_threads
        self._next_probe = 0.0
        self._direction = -1  # the side the next probe tries first
        self._baseline: tuple[float, float] | None = None  # (rows per second, mean rows per step) at self.threads
        self._trial_from: int | None = None  # the size a trial started from
        self._decided: tuple[float, float] | None = None  # (rows per second, rows per step) the last probe kept
        self._sized_by_cores = False  # the size is the cores the threads got: no probe for a new load
        self._rows = self._seconds = self._steps = 0.0
        self._step_seconds = 0.0  # of every step (prefills too) since the last measure
        self._trial_measured = False  # whether the cores were measured since the trial began

    def before_step(self) -> None:
        """Sets the team for the coming step: the governed size."""
        self._apply(self.threads)

    def after_step(self, num_rows: int, decode_only: bool, seconds: float) -> None:
        self._step_seconds += seconds
        if self.ceiling <= 1:
            return
        if self._step_seconds >= self.window_seconds:  # every step counts: a load that starts with many
            self._measure_contention()                 # prompts prefills for seconds before it decodes
            if self._trial_from is None and self._short_now:
                self._shrink_to_cores_got()
        if not decode_only or num_rows == 0:
            return
        self._rows += num_rows
        self._seconds += seconds
        self._steps += 1
        # A window lasts window_seconds too: the baseline of a probe, and a trial, which goes on until
        # the cores its threads got are known. One stream's 16 steps last ~35 ms: beside a neighbour
        # running 4 ms of every 10 on one core of 2 (through `strata up`, small, bfloat16), windows of
        # 16 steps made each size beat the other in turn (six changes in a run of 25 s, 382-395 tok/s),
        # windows of 0.5 s kept two threads throughout (no change in six runs; see _short_of_cores).
        if self._steps < self.window_steps or self._seconds < self.window_seconds or (
                self._trial_from is not None and not self._trial_measured):
            return
        window = (self._rows / self._seconds, self._rows / self._steps)  # (rows per second, rows per step)
        self._rows = self._seconds = self._steps = 0.0
        if self._trial_from is not None:
            self._judge(window)
        elif self._short_now:
            pass  # the next measure says whether it is short of cores again
        elif self._cores_left_idle():  # a team the cores' takers left: try one thread more now
            self._start_trial(window, self.threads + 1)
        elif self._probe_due(window):  # this window is the baseline: try a neighbour
            wanted = self._neighbour()
            if wanted < self.threads and not self._contended():
                return  # alone on the cores: fewer threads would only be slower
            self._direction = -self._direction
            self._start_trial(window, wanted)
        elif self._decided is None:  # no probe kept one yet (or the team shrank): later windows compare with it
            self._decided = window

    def _start_trial(self, baseline: tuple[float, float], threads: int) -> None:
        self._baseline = baseline
        self._trial_from = self.threads
        self._resize(threads)
        self._restart_measure()  # what the trial's threads get, not what the window before's did

    def _restart_measure(self) -> None:
        self._last_core_idle, self._last_core_wait = self._core_idle(), self._core_wait()
        self._step_seconds, self._trial_measured = 0.0, False

    def _measure_contention(self) -> None:
        """The wait for a core, the cores got and the idle cores since the last measure."""
        idle = self._core_idle()
        # the idle cores of the measure before, where the team had the same size (not a trial's)
        idle_before = self.idle_cores if self._idle_measured_at == self.threads else None
        self._idle_measured_at = self.threads
        if idle is None or self._last_core_idle is None or idle[1] <= self._last_core_idle[1]:
            self.idle_cores = None
        else:
            self.idle_cores = idle[2] * (idle[0] - self._last_core_idle[0]) / (idle[1] - self._last_core_idle[1])
        self._last_core_idle = idle
        if idle_before is not None and idle_before < 0.5 and (self.idle_cores or 0.0) >= WHOLE_CORE_IDLE:
            self._idle_trial_after = 0.0  # a core newly idle: its taker left, whatever a trial up met before
        now = self._core_wait()
        if now is None or self._last_core_wait is None:
            self.contended_share = self.cores_got = None
        else:
            waited, ran = now[0] - self._last_core_wait[0], now[1] - self._last_core_wait[1]
            self.contended_share = max(0.0, waited) / max(waited + ran, 1e-9)
            self.cores_got = max(0.0, ran) / self._step_seconds if self._step_seconds > 0 else None
        self._short_now = self._short_of_cores()
        self._last_core_wait = now
        self._step_seconds, self._trial_measured = 0.0, True

    def _contended(self) -> bool:
        """At least CONTENDED_SHARE in the last measure; where none is possible, always (before the
        first, never)."""
        if self.contended_share is None:
            return self._last_core_wait is None
        return self.contended_share >= CONTENDED_SHARE

    def _short_of_cores(self) -> bool:
        """The cores are contended and the last measure's team got WHOLE_CORE_SHORT or more fewer than
        its threads. A neighbour that runs all the time takes a whole core in every measure after the
        one it started in (beside one busy process on 2 cores through ``strata up``, two threads got
        0.98-1.22 cores, waiting 40-55% of their time; alone 1.48-1.98 at 1 and at 64 streams, waiting
        1-14%, 39% in one measure in ~70), so one measure tells it: at one stream the team shrank 1.0 s
        after the busy process started (through `strata up` on 2 cores, bfloat16; one thread decodes
        faster there). One that takes part of a core leaves a team short by less, and faster than one
        thread fewer: beside a neighbour running 4 ms of every 10 on one core of 2, one stream through
        `strata up` (small, bfloat16), two threads got 1.34-1.40 cores, waiting 34-38% of their time.
        Shrunk at half a core short (two measures in a row), the team won its way back by a probe now
        and then and was shrunk again at the next measure (3-17 changes in a run of ~25 s): 340-388
        tok/s in four runs, against 358-405 now (no change) and 380-419 on `--num-threads 2`."""
        return (not self.bound and self.threads > 1 and self.cores_got is not None and self._contended()
                and self.cores_got <= self.threads - WHOLE_CORE_SHORT)

    def _cores_left_idle(self) -> bool:
        """Fewer threads than the ceiling while half a core or more of the usable ones sat idle in the
        last measure, and no trial up lost for probe_every_s."""
        return (self.threads < self.ceiling and self.idle_cores is not None and self.idle_cores >= 0.5
                and self._clock() >= self._idle_trial_after)

    def _shrink_to_cores_got(self) -> None:
        wanted = max(1, round(self.cores_got))
        self._short_now = False  # the measures at the new size start over
        log.info("kernel threads %d -> %d: they got %.2f cores, waiting for one %.0f%% of their time",
                 self.threads, wanted, self.cores_got, 100 * self.contended_share)
        self._resize(wanted)
        self._decided = None  # the next window, at the new size, is what later ones compare with
        self._sized_by_cores = True
        self._next_probe = self._clock() + self.probe_every_s

    def _probe_due(self, window: tuple[float, float]) -> bool:
        """Time for a probe, or the load or the speed moved away from what the last probe saw."""
        if self._clock() >= self._next_probe:
            return True
        if self._decided is None or self._sized_by_cores:
            return False
        (decided_rate, decided_rows), (rate, rows) = self._decided, window
        if not decided_rows / 1.5 < rows < decided_rows * 1.5:
            return True
        return abs(rows - decided_rows) <= 0.1 * decided_rows and not 0.75 <= rate / decided_rate <= 1.33

    def _neighbour(self) -> int:
        """The size a probe tries: one thread more or fewer, alternately (the side that exists)."""
        wanted = self.threads + self._direction
        return wanted if 1 <= wanted <= self.ceiling else self.threads - self._direction

    def _judge(self, trial: tuple[float, float]) -> None:
        (base_rate, base_rows), (rate, rows) = self._baseline, trial
        # Batches of live traffic drift between windows (requests end, prefills interleave), so a trial
        # within a quarter of the baseline's rows counts. A step's time grows with its rows, so rows per
        # second grow at most as fast as the rows: the trial must beat the baseline by more than its
        # extra rows could give it, and a trial with fewer rows only loses by the comparison.
        rows_ratio = rows / base_rows
        went_up = self.threads > self._trial_from
        # more threads than the cores they got is a loss, whatever the batch did meanwhile
        lost_up = went_up and self._short_of_cores()
        comparable = 0.8 <= rows_ratio <= 1.25 or lost_up
        switched = comparable and not lost_up and rate > base_rate * (1 + self.min_gain) * max(1.0, rows_ratio)
        if switched:
            log.info("kernel threads %d -> %d: decode steps of ~%.0f rows run at %.0f rows/s instead of %.0f",
                     self._trial_from, self.threads, rows, rate, base_rate)
        else:
            self._resize(self._trial_from)
        if comparable:
            self._decided = trial if switched else self._baseline  # what the kept size decodes at
            self._sized_by_cores = lost_up
            if went_up and not switched and not lost_up:
                self._idle_trial_after = self._clock() + self.probe_every_s  # idle cores it could not use
        self._baseline = self._trial_from = None
        # a probe across a change of load says nothing: try again soon
        self._next_probe = self._clock() + (self.probe_every_s if comparable else self.retry_s)

    def _resize(self, threads: int) -> None:
        self.threads = threads
        self._apply(threads)

    def _apply(self, threads: int) -> None:
        """Sets the calling thread's team (steps may run on two threads: `AsyncEngine.drive`)."""
        if threads != getattr(self._applied, "threads", None):
            if self._set_threads is None:
                import torch

                torch.set_num_threads(threads)
            else:
                self._set_threads(threads)
            self._applied.threads = threads


# A probe down to fewer threads needs the process's threads to have waited for a core at least this
# share of their runnable time. Measured on 2 cores (one engine thread per core): alone ~1%; through
# `strata up` at 1 and at 64 streams, the gateway, tokenizer and clients beside it, 23-26% (two
# threads decode faster there); beside one busy process ~49% (one thread may decode faster).
CONTENDED_SHARE = 1 / 3
# A measure whose team got this many cores fewer than its threads shrinks it at once (`_short_of_cores`).
WHOLE_CORE_SHORT = 0.75
# Idle cores that were under half a core in the measure before: a neighbour left, and a team below the
# ceiling tries one thread more at once even where a trial up lost within probe_every_s. Beside a busy
# process of another session (Linux's autogroup gives it a core of its own), one engine thread waits for
# no core, so its wait cannot tell that the neighbour left; the core it leaves idle can. In-process on 2
# cores, one stream, where a trial up had lost 6 s before the busy process ended, the team went back to
# two threads only 4.5 s after it ended, when probe_every_s ran out; through `strata up`, rounds of 12
# requests right after a busy process ended ran on one thread now and then, 188-195 tok/s against
# 265-298 (after this change, three rounds: 280-292).
WHOLE_CORE_IDLE = 0.9


def process_core_wait() -> tuple[float, float] | None:
    """(seconds waiting for a core, seconds on one) summed over this process's threads so far, from
    /proc/self/task/*/schedstat (Linux); None where that is not available."""
    waited = ran = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                on_cpu, run_delay = stat.read().split()[:2]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile, or no schedstat here
        ran += int(on_cpu)
        waited += int(run_delay)
    return (waited / 1e9, ran / 1e9) if ran else None


def usable_cores_idle() -> tuple[int, int, int] | None:
    """(idle clock ticks, all clock ticks, cores) so far of the cores this process may run on, from
    /proc/stat (Linux); None where that is not available."""
    try:
        cores = os.sched_getaffinity(0)
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines()
    except (OSError, AttributeError):
        return None
    idle = total = counted = 0
    for line in lines:
        name, _, fields = line.partition(" ")
        if not name.startswith("cpu"):
            break  # the cores' lines come first
        if name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(field) for field in fields.split()[:8]]  # user .. steal
            idle += ticks[3] + ticks[4]  # idle, iowait
            total += sum(ticks)
            counted += 1
    return (idle, total, counted) if counted else None


def thread_governor(num_threads: int | None, bound: bool = False) -> ThreadGovernor | None:
    """The governor of an engine whose thread count was not fixed with ``--num-threads``: it adapts
    between one thread and ``resolve_num_threads`` (OMP_NUM_THREADS, else the usable cores); ``bound``:
    its steps bind their threads one per core."""
    if num_threads is not None:
        return None
    return ThreadGovernor(resolve_num_threads(None, os.environ), bound=bound)
