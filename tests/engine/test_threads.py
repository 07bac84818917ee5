"""The engine's thread count and OpenMP wait policy: which setting wins, and that the entry points
put the policy into the environment before torch loads."""

import os
import subprocess
import sys

from services.engine.threads import OPENMP_SPIN_COUNT, openmp_wait_env, resolve_num_threads, usable_cores
from services.launcher import Stack, StackConfig


def test_the_wait_policy_is_a_short_spin_unless_the_user_named_one():
    assert openmp_wait_env({}) == {"GOMP_SPINCOUNT": str(OPENMP_SPIN_COUNT)}
    assert openmp_wait_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_wait_env({"GOMP_SPINCOUNT": "0"}) == {}


def test_num_threads_flag_then_omp_num_threads_then_usable_cores():
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert resolve_num_threads(3, {"OMP_NUM_THREADS": "5"}) == 3
    assert resolve_num_threads(None, {"OMP_NUM_THREADS": "5"}) == 5
    assert resolve_num_threads(None, {}) == usable_cores()
    assert resolve_num_threads(None, {"OMP_NUM_THREADS": "4,2"}) == usable_cores()  # nested lists: ours


def test_strata_sets_the_wait_policy_before_torch_loads():
    code = ("import sys, os\n"
            "from services import cli\n"
            "sys.modules['services.engine.offline'] = type(sys)('stub')\n"
            "sys.modules['services.engine.offline'].main = lambda argv: print(os.environ.get('GOMP_SPINCOUNT'),"
            " 'torch' in sys.modules)\n"
            "cli.main(['generate'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(OPENMP_SPIN_COUNT), "False"]


def test_the_launcher_gives_one_replica_as_many_their_threads_and_wait_policy(monkeypatch):
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for replicas in (1, 2):
        env = Stack(StackConfig(replicas=replicas))._engine_env()
        assert env == {"GOMP_SPINCOUNT": str(OPENMP_SPIN_COUNT),
                       "OMP_NUM_THREADS": str(max(1, usable_cores() // replicas))}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert Stack(StackConfig())._engine_env() == {}
