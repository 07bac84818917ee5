"""The supervisor on real child processes: a child that dies is started again after its backoff,
one that keeps dying before it is healthy is a crash loop named with its exit code and log, and a
retired child is let go."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.common.supervisor import ChildProcess, Supervisor
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # starts and kills child processes


def child(name: str, code: str) -> ChildProcess:
    return ChildProcess(name, [sys.executable, "-c", code], echo=False)


def recorder():
    events, lock = [], threading.Lock()

    def on_change(name, event, detail):
        with lock:
            events.append((name, event, detail))

    return events, on_change


def test_a_killed_child_is_started_again_after_its_backoff():
    events, on_change = recorder()
    supervisor = Supervisor(initial_backoff_s=0.3, on_change=on_change)
    sleeper = child("sleeper", "import time; print('hello', flush=True); time.sleep(60)")
    sleeper.spawn()
    sleeper.start_reader()
    supervisor.watch(sleeper, lambda: True)
    supervisor.start()
    try:
        first_pid = sleeper.pid
        os.kill(first_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: ("sleeper", "up") in [(n, e) for n, e, _ in events])
        assert time.monotonic() - killed_at >= 0.3, "restarted before its backoff"
        assert sleeper.starts == 2 and sleeper.pid != first_pid and sleeper.exit_code is None
        assert [e for _, e, _ in events] == ["down", "up"]
        assert "exited with code -9" in events[0][2]
        assert supervisor.fatal is None
    finally:
        supervisor.stop()
        sleeper.terminate()
        sleeper.wait_or_kill(time.monotonic() + 5)


def test_a_child_that_keeps_crashing_at_start_is_fatal_and_named():
    events, on_change = recorder()
    supervisor = Supervisor(initial_backoff_s=0.02, max_backoff_s=0.1, max_failed_starts=3, on_change=on_change)
    crasher = child("crasher", "print('no checkpoint here', flush=True); raise SystemExit(3)")
    supervisor.add(crasher, lambda: False)
    supervisor.start()
    try:
        assert supervisor.wait_failed(20), "never gave up"
        message = str(supervisor.fatal)
        assert "crasher keeps crashing at start (3 times in a row)" in message
        assert "exited with code 3" in message and "no checkpoint here" in message
        assert crasher.starts == 3
        assert [e for _, e, _ in events] == ["restarting", "restarting"]
    finally:
        supervisor.stop()


def test_a_retired_child_is_not_restarted():
    events, on_change = recorder()
    supervisor = Supervisor(initial_backoff_s=0.05, on_change=on_change)
    sleeper = child("retiree", "import time; time.sleep(60)")
    supervisor.add(sleeper, lambda: True)
    supervisor.start()
    try:
        wait_until(lambda: any(e == "up" for _, e, _ in events))
        supervisor.retire("retiree")
        wait_until(lambda: any(e == "gone" for _, e, _ in events))
        time.sleep(0.3)  # part of what is tested: six of its 0.05 s backoffs, in which a restart would come
        assert sleeper.starts == 1 and sleeper.exit_code == -signal.SIGTERM
        assert supervisor.children() == []
    finally:
        supervisor.stop()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_a_batch_scheduled_child_and_the_threads_it_starts_run_sched_batch():
    code = ("import os, threading; t = threading.Thread(target=lambda: print(os.sched_getscheduler(0))); "
            "t.start(); t.join()")
    for batch_scheduled, expected in ((True, os.SCHED_BATCH), (False, os.SCHED_OTHER)):
        process = ChildProcess("probe", [sys.executable, "-c", code], echo=False, batch_scheduled=batch_scheduled)
        process.spawn()
        output, _ = process.process.communicate(timeout=30)
        assert int(output) == expected


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_a_batch_scheduled_process_starts_its_other_children_as_usual():
    """A batch-scheduled autoscaler's engines: a fork passes the policy on; ChildProcess does not."""
    code = ("import os, sys; from services.common.supervisor import ChildProcess; "
            "os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); "
            "child = ChildProcess('engine', [sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'], "
            "echo=False); child.spawn(); print(child.process.communicate(timeout=30)[0].decode().strip())")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=True).stdout
    assert int(output) == os.SCHED_OTHER
