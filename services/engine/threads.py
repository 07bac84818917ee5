"""The engine's CPU threads: how many run the model's kernels, and how OpenMP's idle ones wait.

Both are set where an engine process starts (`strata engine`, `strata generate`, `strata bench`),
and by the launcher for its engine children:

- The wait policy goes into the environment before torch is imported: GNU libgomp (torch's OpenMP)
  reads it once, when it loads. libgomp's own default spins an idle thread ~300,000 times (a few
  milliseconds) before it sleeps, so between the many small parallel regions of a decode step the
  threads never sleep. On an idle machine that saves a wake-up per region; on a core shared with
  another busy process the spinning threads burn the time slices that the thread holding the work
  needs, and a step takes 10-20x longer. `GOMP_SPINCOUNT` caps the spin; a user's own
  `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is left as it is.
- The thread count: `--num-threads`, else `OMP_NUM_THREADS` when set, else the cores this process
  may run on (its CPU affinity, which `taskset`, cgroups' cpusets and container limits narrow).
"""

import os
from collections.abc import Mapping

# Spins before an idle OpenMP thread sleeps. One spin (a PAUSE and a load) took ~160 ns on the
# 2-vCPU Zen 4 VM this was tuned on, so libgomp's 300,000 spin ~50 ms and 10,000 still ~1.7 ms, longer
# than a small model's whole step; 1,000 (~0.2 ms there, less on bare metal) bridges the gaps between
# the parallel regions of one step and lets the core go soon after it. Measured there, one stream
# through `strata up` on the tiny model: the engine used 18-20 ms of CPU per token at 10,000, 9-14
# at 1,000, 9-11 at 0 (passive). The price on an idle machine: the small shape's bfloat16 batch-1
# decode step (two threads) took 7.7 ms at 1,000 spins and 5.1 ms at 10,000 alone, but 9.7 ms and
# 27.6 ms beside one busy process (300,000: 5.0 and 18.5 ms; one thread at 1,000: 7.0 and 7.7 ms).
# Shared cores are the case that collapses, so the default guards it; dedicated cores may spin more.
OPENMP_SPIN_COUNT = 1_000
_WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_wait_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for the engine's wait policy: none when it already
    names one."""
    if any(name in environ for name in _WAIT_POLICY_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": str(OPENMP_SPIN_COUNT)}


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


def set_num_threads(num_threads: int | None) -> int:
    """Sets torch's intra-op thread count (see `resolve_num_threads`); returns it. Call it from the
    thread that will run the model's steps, before the first one."""
    import torch

    resolved = resolve_num_threads(num_threads, os.environ)
    torch.set_num_threads(resolved)
    return resolved
