"""The engine's thread count and OpenMP wait policy: which setting wins, and that the entry points
put the policy into the environment before torch loads."""

import os
import subprocess
import sys
import threading

import pytest

from services.engine.cpu_kernels.build import load_library
from services.engine.threads import (
    OPENMP_SPIN_SECONDS,
    ThreadGovernor,
    binding_cores,
    openmp_spin_count,
    openmp_wait_env,
    resolve_num_threads,
    spin_count_for,
    thread_governor,
    usable_cores,
)
from services.launcher import Stack, StackConfig


def test_the_wait_policy_is_a_short_spin_unless_the_user_named_one():
    assert openmp_wait_env({}) == {"GOMP_SPINCOUNT": str(openmp_spin_count())}
    assert openmp_wait_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_wait_env({"GOMP_SPINCOUNT": "0"}) == {}


def test_the_spin_count_is_the_spin_time_over_one_spin():
    assert spin_count_for(160e-9) == 1_000  # the Zen 4 this was first tuned on
    assert spin_count_for(12e-9) == 13_000  # a Xeon with AMX
    assert spin_count_for(1e-3) == 100 and spin_count_for(0.0) == 1_000_000  # clamped
    assert OPENMP_SPIN_SECONDS == 160e-6


def test_this_cpus_spin_count_comes_from_timing_libgomps_loop():
    library = load_library("spin.cpp")
    if library is None:
        pytest.skip("no C++ compiler: the fallback count")
    assert library.strata_spin_seconds(1000) > 0
    assert 100 <= openmp_spin_count() <= 1_000_000


def test_num_threads_flag_then_omp_num_threads_then_usable_cores():
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert resolve_num_threads(3, {"OMP_NUM_THREADS": "5"}) == 3
    assert resolve_num_threads(None, {"OMP_NUM_THREADS": "5"}) == 5
    assert resolve_num_threads(None, {}) == usable_cores()
    assert resolve_num_threads(None, {"OMP_NUM_THREADS": "4,2"}) == usable_cores()  # nested lists: ours


@pytest.mark.parametrize("entry, module, argv", [
    ("from services import cli as entry", "services.engine.offline", ["generate"]),  # `strata generate`
    # `python -m services.bench overhead`: an engine in-process without `strata`'s entry point
    ("from services.bench import __main__ as entry", "services.bench.overhead", ["overhead"]),
])
def test_the_entry_points_set_the_wait_policy_before_torch_loads(entry, module, argv):
    code = (f"import sys, os\n{entry}\n"
            f"sys.modules[{module!r}] = type(sys)('stub')\n"
            f"sys.modules[{module!r}].main = lambda argv: print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
            f"entry.main({argv!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    spin_count, torch_loaded = out.split()
    assert 100 <= int(spin_count) <= 1_000_000 and torch_loaded == "False"  # timed in that process


def test_the_launcher_gives_one_replica_as_many_their_threads_and_wait_policy(monkeypatch):
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for replicas in (1, 2):
        env = Stack(StackConfig(replicas=replicas))._engine_env()
        assert env == {"GOMP_SPINCOUNT": str(openmp_spin_count()),
                       "OMP_NUM_THREADS": str(max(1, usable_cores() // replicas))}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert Stack(StackConfig())._engine_env() == {}



class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CoreWait:
    """The process's (seconds waiting for a core, seconds on one) as its threads would add them up:
    running on ``cores`` cores (a number, or a callable giving it) as time passes on ``clock``, and
    waiting for one ``share`` of their runnable time; ``share`` None: not known here."""

    def __init__(self, clock: Clock, share: float | None, cores=1.0) -> None:
        self.clock, self.share, self.cores = clock, share, cores
        self.waited = self.ran = 0.0
        self.seen = 0.0

    def __call__(self) -> tuple[float, float] | None:
        if self.share is None:
            return None
        passed, self.seen = self.clock.now - self.seen, self.clock.now
        ran = passed * (self.cores() if callable(self.cores) else self.cores)
        self.ran += ran
        self.waited += ran * self.share / (1 - self.share)
        return self.waited, self.ran


class CoreIdle:
    """The usable cores' (idle clock ticks, all clock ticks, cores) as /proc/stat would count them,
    ``idle`` of the ``cores`` left idle as time passes on ``clock``."""

    def __init__(self, clock: Clock, cores: int, idle: float = 0.0) -> None:
        self.clock, self.cores, self.idle = clock, cores, idle
        self.idle_ticks = self.ticks = 0.0
        self.seen = 0.0

    def __call__(self) -> tuple[float, float, int]:
        passed, self.seen = self.clock.now - self.seen, self.clock.now
        self.idle_ticks += passed * self.idle * 100
        self.ticks += passed * self.cores * 100
        return self.idle_ticks, self.ticks, self.cores


def make_governor(ceiling: int, step_ms, contended: float | None = 0.5) -> tuple[ThreadGovernor, list[int], Clock]:
    """A governor whose decode steps take ``step_ms(threads, rows)``, its threads waiting for a core
    ``contended`` of their time (``governor.core_wait.share``) and each getting a core of its own
    (``governor.core_wait.cores``), on ``ceiling`` cores none of which sits idle
    (``governor.core_idle.idle``); returns it, the sizes it set and its clock."""
    sizes, clock = [], Clock()
    core_wait, core_idle = CoreWait(clock, contended), CoreIdle(clock, ceiling)
    governor = ThreadGovernor(ceiling, probe_every_s=10.0, window_steps=4, window_seconds=0.01, clock=clock,
                              set_threads=sizes.append, core_wait=core_wait, core_idle=core_idle)
    core_wait.cores = lambda: governor.threads
    governor.step_ms, governor.core_wait, governor.core_idle = step_ms, core_wait, core_idle
    return governor, sizes, clock


def decode(governor: ThreadGovernor, clock: Clock, rows: int, steps: int) -> None:
    for _ in range(steps):
        seconds = governor.step_ms(governor.threads, rows) / 1e3
        clock.now += seconds
        governor.after_step(rows, True, seconds)


def test_governor_keeps_fewer_threads_when_they_decode_faster():
    # one stream through the stack: the second thread loses its core to the gateway and tokenizer
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 4.6, 2: 5.9}[threads])
    decode(governor, clock, 1, 8)  # the first window is the baseline, the second runs on one thread
    assert governor.threads == 1 and sizes == [1]
    decode(governor, clock, 1, 400)  # 1.8 s: no probe before probe_every_s
    assert sizes == [1]
    clock.now += 10.0
    decode(governor, clock, 1, 8)  # the next probe tries two again, and goes back
    assert governor.threads == 1 and sizes == [1, 2, 1]


def test_governor_keeps_every_thread_when_they_help_and_ignores_other_steps():
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 45.0, 2: 26.0}[threads])
    for _ in range(20):
        clock.now += 0.1
        governor.after_step(300, False, 0.1)  # mixed steps say nothing about decoding
    assert sizes == []
    decode(governor, clock, 64, 8)
    assert governor.threads == 2 and sizes == [1, 2]


def test_governor_moves_one_thread_at_a_time_and_needs_a_clear_gain():
    governor, sizes, clock = make_governor(8, lambda threads, rows: 10.0 + abs(threads - 5))
    for _ in range(6):
        decode(governor, clock, 8, 8)
        clock.now += 10.0
    assert governor.threads == 5
    governor, sizes, clock = make_governor(4, lambda threads, rows: 10.0 - 0.2 * threads)  # 2% better: no move
    decode(governor, clock, 8, 8)
    assert governor.threads == 4 and sizes == [3, 4]


def test_a_probe_across_a_change_of_batch_size_is_thrown_away():
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 2.0, 2: 3.0}[threads])
    decode(governor, clock, 64, 4)  # baseline at 64 rows
    decode(governor, clock, 8, 4)
    assert sizes == [1]  # 8 ms of trial: not window_seconds yet, the trial goes on
    decode(governor, clock, 8, 4)  # the trial saw another load: not comparable
    assert governor.threads == 2 and sizes == [1, 2]


def test_no_governor_when_the_thread_count_is_fixed():
    assert thread_governor(3) is None
    assert thread_governor(None).ceiling == resolve_num_threads(None, os.environ)


def test_a_new_load_starts_a_probe_at_once():
    # one stream decodes faster on one thread, a full batch on two
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 4.0 + 0.6 * rows, 2: 5.0 + 0.3 * rows}[threads])
    decode(governor, clock, 1, 8)
    assert governor.threads == 1
    decode(governor, clock, 64, 8)  # well before probe_every_s: the batch grew 64x
    assert governor.threads == 2 and sizes == [1, 2]


def test_a_neighbour_slowing_the_same_batch_starts_a_probe_at_once():
    neighbour = {"busy": False}
    governor, sizes, clock = make_governor(
        2, lambda threads, rows: ({1: 5.0, 2: 9.0} if neighbour["busy"] else {1: 4.0, 2: 2.5})[threads])
    decode(governor, clock, 1, 8)
    assert governor.threads == 2 and sizes == [1, 2]
    neighbour["busy"] = True  # a window 3.6x slower, long before probe_every_s
    decode(governor, clock, 1, 12)
    assert governor.threads == 1 and sizes == [1, 2, 1]


def test_every_step_runs_on_the_governed_team():
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 4.0, 2: 6.0}[threads])
    decode(governor, clock, 1, 8)
    assert governor.threads == 1 and sizes == [1]
    governor.before_step()
    assert sizes == [1]  # unchanged: nothing to set
    governor.after_step(300, False, 0.05)  # a step that prefilled: on the same team, no window of its own
    governor.before_step()
    assert sizes == [1] and governor.threads == 1


def test_short_of_cores_the_team_shrinks_to_the_cores_it_got_at_once():
    # beside a busy process on 2 cores: two threads get 0.95 cores between them, waiting 48% of the time
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 30.0, 2: 28.0}[threads] + 0.1 * rows,
                                           contended=0.48)
    governor.core_wait.cores = 0.95
    decode(governor, clock, 30, 1)  # a whole core short in one measure (a step is more than window_seconds)
    assert governor.threads == 1 and sizes == [1] and governor.cores_got == pytest.approx(0.95)  # no probe
    decode(governor, clock, 40, 40)  # a ramping batch and the window at the new size: no probe before probe_every_s
    assert sizes == [1]
    clock.now += 10.0
    decode(governor, clock, 64, 8)  # the probe up: two threads still get under one core, lost at any batch
    assert governor.threads == 1 and sizes == [1, 2, 1]
    decode(governor, clock, 30, 40)  # the next comes after probe_every_s: not after retry_s, nor for a new batch
    assert sizes == [1, 2, 1]
    governor.core_wait.cores, governor.core_wait.share = (lambda: governor.threads), 0.05  # the neighbour left
    governor.core_idle.idle = 0.9  # and its core sits idle: a trial up at once, before probe_every_s
    governor.step_ms = lambda threads, rows: {1: 30.0, 2: 18.0}[threads] + 0.1 * rows
    decode(governor, clock, 30, 8)
    assert governor.threads == 2 and sizes == [1, 2, 1, 2]


def test_idle_cores_start_a_trial_up_and_one_it_loses_waits_for_probe_every_s():
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 4.6, 2: 5.9}[threads])
    decode(governor, clock, 1, 8)  # one stream through the stack: the probe keeps one thread
    assert governor.threads == 1 and sizes == [1]
    governor.core_idle.idle = 0.6  # the other core idles part of the time, and two threads are still slower
    decode(governor, clock, 1, 8)
    assert governor.threads == 1 and sizes == [1, 2, 1]
    decode(governor, clock, 1, 40)
    assert sizes == [1, 2, 1]  # not again before probe_every_s
    clock.now += 10.0
    decode(governor, clock, 1, 8)
    assert sizes == [1, 2, 1, 2, 1]
    governor.core_idle.idle = 0.3  # less than half a core idle: nothing before probe_every_s
    governor.step_ms = lambda threads, rows: {1: 4.6, 2: 3.0}[threads]
    decode(governor, clock, 1, 40)
    assert sizes == [1, 2, 1, 2, 1] and governor.idle_cores == pytest.approx(0.3)
    # on every thread already: idle cores start nothing
    governor, sizes, clock = make_governor(2, lambda threads, rows: 3.0, contended=0.05)
    governor.core_idle.idle = 0.9
    decode(governor, clock, 1, 40)
    assert sizes == [] and governor.idle_cores == pytest.approx(0.9)


def test_steps_that_prefill_show_the_cores_it_got_before_any_window_of_decode_steps():
    governor, sizes, clock = make_governor(2, lambda threads, rows: 10.0, contended=0.48)
    governor.core_wait.cores, governor.window_seconds = 0.95, 0.5
    for _ in range(3):
        assert sizes == [] and governor.cores_got is None  # not measured before window_seconds
        clock.now += 0.2
        governor.after_step(64, False, 0.2)
    assert governor.threads == 1 and sizes == [1] and governor.cores_got == pytest.approx(0.95)  # after 0.6 s


def test_the_team_shrinks_to_the_cores_it_got_only_where_they_were_contended():
    governor, sizes, clock = make_governor(8, lambda threads, rows: 10.0, contended=0.4)
    governor.core_wait.cores = 5.3
    decode(governor, clock, 8, 8)
    assert governor.threads == 5 and sizes == [5]
    governor, sizes, clock = make_governor(2, lambda threads, rows: 10.0, contended=0.1)  # little wait: not a neighbour
    governor.core_wait.cores = 1.2
    decode(governor, clock, 8, 40)
    assert governor.threads == 2 and sizes == []
    governor, sizes, clock = make_governor(2, lambda threads, rows: 10.0, contended=0.48)  # within half a core
    governor.core_wait.cores = 1.6
    decode(governor, clock, 8, 4)
    assert sizes == [1]  # a probe, not a shrink: it tries one thread and goes back at equal speed
    decode(governor, clock, 8, 4)
    assert governor.threads == 2 and sizes == [1, 2]
    governor, sizes, clock = make_governor(2, lambda threads, rows: 10.0, contended=0.48)  # short once
    governor.core_wait.cores = 1.4  # by less than WHOLE_CORE_SHORT: a moment's taker, maybe
    decode(governor, clock, 8, 1)
    governor.core_wait.cores = lambda: governor.threads
    decode(governor, clock, 8, 40)
    assert governor.threads == 2 and sizes == [1, 2]  # then only the probe the next window started
    # a neighbour that takes part of a core all along: two threads get 1.35 cores and decode faster than one
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 11.0, 2: 10.0}[threads], contended=0.37)
    governor.core_wait.cores = lambda: {1: 1.0, 2: 1.35}[governor.threads]
    decode(governor, clock, 8, 400)
    assert governor.threads == 2 and sizes == [1, 2]  # no shrink: the probe down lost and went back


def test_alone_on_its_cores_it_never_probes_fewer_threads():
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 45.0, 2: 26.0}[threads], contended=0.01)
    decode(governor, clock, 64, 40)
    decode(governor, clock, 8, 40)  # a new load: still no probe
    clock.now += 60.0
    decode(governor, clock, 8, 40)
    assert sizes == [] and governor.threads == 2 and governor.contended_share == pytest.approx(0.01)


def test_a_neighbour_taking_the_cores_lets_it_probe_and_fewer_threads_probe_up_regardless():
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 5.0, 2: 9.0}[threads], contended=0.01)
    decode(governor, clock, 1, 8)
    assert sizes == []
    governor.core_wait.share = 0.5  # a busy neighbour: the threads wait for a core half the time
    decode(governor, clock, 1, 8)
    assert governor.threads == 1 and sizes == [1]
    governor.core_wait.share = 0.01  # it left: one thread has its core, and the probe up still runs
    governor.step_ms = lambda threads, rows: {1: 4.0, 2: 2.5}[threads]
    clock.now += 10.0  # the next probe is due
    decode(governor, clock, 1, 8)
    assert governor.threads == 2 and sizes == [1, 2]


def test_no_probe_down_before_the_wait_for_a_core_was_measured_over_window_seconds():
    # one stream: 16 steps of ~2 ms are too few to tell contention from a moment's noise
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 1.8, 2: 2.0}[threads], contended=0.5)
    governor.window_seconds = 0.5
    decode(governor, clock, 1, 200)  # 0.4 s
    assert sizes == [] and governor.contended_share is None
    decode(governor, clock, 1, 60)  # measured: the next window probes, and the trial lasts window_seconds
    assert sizes == [1] and governor.contended_share == pytest.approx(0.5)
    decode(governor, clock, 1, 200)
    assert sizes == [1]
    decode(governor, clock, 1, 100)
    assert governor.threads == 1 and sizes == [1]  # kept: 10% faster


def test_where_the_wait_for_a_core_is_unknown_it_probes_as_before():
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 4.6, 2: 5.9}[threads], contended=None)
    decode(governor, clock, 1, 8)
    assert governor.threads == 1 and sizes == [1] and governor.contended_share is None


def test_this_process_wait_for_a_core_is_read_from_proc():
    from services.engine.threads import process_core_wait

    reading = process_core_wait()
    if not os.path.exists("/proc/self/task"):
        assert reading is None
    else:
        waited, ran = reading
        assert waited >= 0 and ran > 0


def test_the_usable_cores_idle_time_is_read_from_proc_stat():
    from services.engine.threads import usable_cores_idle

    reading = usable_cores_idle()
    if not os.path.exists("/proc/stat"):
        assert reading is None
    else:
        idle, total, cores = reading
        assert 0 <= idle <= total and cores == len(os.sched_getaffinity(0))


def test_a_trial_at_a_somewhat_larger_batch_must_beat_what_its_extra_rows_give():
    # rows per second grow with the batch: 10% more rows and 8% more rows/s is no gain of its own
    governor, sizes, clock = make_governor(2, lambda threads, rows: 20.0 + 0.1 * rows)
    decode(governor, clock, 50, 4)  # the baseline, on two threads
    governor.step_ms = lambda threads, rows: 20.0 + 0.1 * rows  # the same speed on one thread
    decode(governor, clock, 55, 4)
    assert governor.threads == 2 and sizes == [1, 2]
    # a drifting batch still gets its answer: one thread faster at 15% fewer rows
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 18.0, 2: 25.0}[threads] + 0.1 * rows)
    decode(governor, clock, 60, 4)
    decode(governor, clock, 51, 4)
    assert governor.threads == 1 and sizes == [1]


def test_governor_sets_the_team_of_each_thread_that_runs_a_step():
    # AsyncEngine.drive runs short steps on the event loop's thread and long ones on a step thread;
    # OpenMP's team size is per thread, so each gets the governed size before its first step
    sizes: list[tuple[str, int]] = []
    governor = ThreadGovernor(2, set_threads=lambda n: sizes.append((threading.current_thread().name, n)),
                              core_wait=lambda: None, core_idle=lambda: None)
    governor.before_step()  # the creating thread: set_num_threads set its team
    assert sizes == []
    governor._resize(1)
    other = threading.Thread(target=governor.before_step, name="step")
    other.start()
    other.join()
    governor.before_step()
    assert sizes == [("MainThread", 1), ("step", 1)]


def test_a_window_lasts_window_seconds_so_a_neighbours_bursts_average_out():
    # one stream beside a neighbour on for 40 ms of every 100: two threads decode at 2 ms a step, 3.2
    # while it runs (2.48 on average), one thread at 2.6, 2.8 while it runs (2.68): a baseline of a
    # few steps inside a burst made one thread look faster, and it flapped between the sizes
    governor, sizes, clock = make_governor(2, None, contended=0.4)
    governor.window_seconds = 0.2
    governor.core_wait.cores = lambda: {1: 1.0, 2: 1.5}[governor.threads]

    def step_ms(threads: int, rows: int) -> float:
        bursting = clock.now % 0.1 < 0.04
        return ({1: 2.8, 2: 3.2} if bursting else {1: 2.6, 2: 2.0})[threads]

    governor.step_ms = step_ms
    for _ in range(6):
        decode(governor, clock, 1, 2500)  # ~6 s, then the next probe is due
        clock.now += 10.0
    assert governor.threads == 2 and sizes == [1, 2] * 6  # every probe down lost


def test_a_bound_team_is_sized_by_probes_not_by_the_cores_it_got():
    # beside a busy process of the same session: two bound threads get 1.2 cores and decode faster
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 5.0, 2: 3.7}[threads], contended=0.45)
    governor.bound = True
    governor.core_wait.cores = lambda: {1: 1.0, 2: 1.2}[governor.threads]
    decode(governor, clock, 1, 400)
    assert governor.threads == 2 and sizes == [1, 2]  # the probe down lost; no shrink to the cores got
    clock.now += 10.0
    decode(governor, clock, 1, 8)  # the next probe (down: two is the ceiling) loses again
    assert governor.threads == 2 and sizes == [1, 2, 1, 2]
    # beside one of another session: the same cores got, but one thread decodes faster
    governor, sizes, clock = make_governor(2, lambda threads, rows: {1: 5.0, 2: 5.8}[threads], contended=0.45)
    governor.bound = True
    governor.core_wait.cores = lambda: {1: 1.0, 2: 1.2}[governor.threads]
    decode(governor, clock, 1, 40)
    assert governor.threads == 1 and sizes == [1]


def test_binding_cores_are_the_usable_ones_where_the_threads_may_fill_them(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 2, 3})
    assert binding_cores(True, None, {}) == (2, 3, 5)  # the default thread count: every usable core
    assert binding_cores(True, 3, {}) == (2, 3, 5)
    assert binding_cores(True, None, {"OMP_NUM_THREADS": "3"}) == (2, 3, 5)
    assert binding_cores(True, 2, {}) == ()  # fewer threads than cores: the OS places them
    assert binding_cores(True, None, {"OMP_NUM_THREADS": "2"}) == ()
    assert binding_cores(False, None, {}) == ()  # --no-bind-threads
    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        assert binding_cores(True, None, {name: "true"}) == ()  # OpenMP binds them itself
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4})
    assert binding_cores(True, None, {}) == ()  # one core: nothing to spread


def test_a_core_newly_idle_starts_a_trial_up_even_after_a_lost_one():
    # beside a busy process of another session: one thread decodes faster than two bound ones, and waits
    # for no core (autogroup gives the neighbour a core of its own)
    neighbour = {"busy": True}
    governor, sizes, clock = make_governor(
        2, lambda threads, rows: ({1: 5.0, 2: 5.8} if neighbour["busy"] else {1: 4.5, 2: 2.5})[threads],
        contended=0.45)
    governor.bound = True
    decode(governor, clock, 1, 40)
    assert governor.threads == 1 and sizes == [1]
    governor.core_wait.share = 0.01
    clock.now += 10.0
    decode(governor, clock, 1, 40)  # the probe up loses: idle cores start no trial for probe_every_s
    assert governor.threads == 1 and sizes == [1, 2, 1]
    decode(governor, clock, 1, 40)
    assert sizes == [1, 2, 1]
    neighbour["busy"], governor.core_idle.idle = False, 1.0  # it left: its core sits idle
    decode(governor, clock, 1, 40)  # long before probe_every_s
    assert governor.threads == 2 and sizes == [1, 2, 1, 2]
