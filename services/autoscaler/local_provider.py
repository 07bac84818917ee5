"""Engine replicas as processes on this machine (`strata up --autoscale`, or `strata autoscaler
--provider local`).

Each replica is `python -m services.engine <engine args> --replica-id engine-<k> --port <free>
--metrics-port <free>` with ``--nats-url``, so it announces itself with its load reports and the router adds it once it is
SERVING; ``k`` only grows, so a replica id never names two processes. Each one gets its own share
of the cores: ``OMP_NUM_THREADS`` = cores ÷ --max-replicas (unless the environment sets it), and a
CPU affinity of its own slot's cores, so replicas do not spin against each other. The replicas are
supervised (`services.common.supervisor`): one that crashes is restarted with backoff. Scale-down
retires the replicas still starting first, then the newest: SIGTERM, which drains them.
"""

import logging
import os
import sys
import time
from pathlib import Path

from services.autoscaler.provider import FleetState
from services.common.ports import find_free_port
from services.common.supervisor import ChildProcess, ChildStatus, Supervisor
from services.common.tls import TlsFiles
from services.engine.threads import openmp_wait_env

log = logging.getLogger(__name__)


def _serving(address: str, tls: TlsFiles | None) -> bool:
    from services.common.health_probe import serving

    return serving(address, timeout_s=1.0, tls=tls)


class LocalProcessProvider:
    name = "local"

    def __init__(self, engine_args: list[str], max_replicas: int, host: str = "127.0.0.1",
                 log_dir: Path | None = None, echo_logs: bool = True, drain_timeout_s: float = 60.0,
                 python: str = sys.executable, tls: TlsFiles | None = None) -> None:
        self.tls = tls
        self.engine_argv = [python, "-m", "services.engine", "--host", host, *engine_args,
                            *(tls.flags() if tls else [])]
        self.host = host
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.echo_logs = echo_logs
        cores = sorted(os.sched_getaffinity(0))
        self.threads_per_replica = max(1, len(cores) // max_replicas)
        self._slot_cores = [{cores[(slot * self.threads_per_replica + i) % len(cores)]
                             for i in range(self.threads_per_replica)} for slot in range(max_replicas)]
        self._slots: dict[str, int] = {}  # replica name -> its slot (cores)
        self._next_id = 0
        self.supervisor = Supervisor(retire_grace_s=drain_timeout_s + 10.0, on_change=self._on_change)
        self.supervisor.start()

    def _on_change(self, name: str, event: str, detail: str) -> None:
        log.info("replica %s %s", name, detail)
        if event == "gone":
            self._slots.pop(name, None)

    def _live(self) -> list[ChildStatus]:
        return [status for status in self.supervisor.children() if not status.retired]

    def state(self) -> FleetState:
        live = self._live()
        now = time.monotonic()
        starting = [now - status.started_at for status in live if not status.up]
        pending = len(self._slots) - len(self.supervisor.children())  # added, not spawned yet
        if pending > 0:
            starting.append(0.0)
        return FleetState(current=len(live) + max(0, pending), ready=sum(1 for status in live if status.up),
                          oldest_starting_s=max(starting) if starting else None)

    def scale_to(self, count: int, reason: str) -> None:
        live = self._live()
        for _ in range(count - self.state().current):
            self._start_one()
        if count < len(live):  # the starting ones first (they serve nobody yet), then the newest
            newest_first = sorted(live, key=lambda status: -status.started_at)
            victims = [s for s in newest_first if not s.up] + [s for s in newest_first if s.up]
            for status in victims[:len(live) - count]:
                self.supervisor.retire(status.child.name)

    def _start_one(self) -> None:
        name = f"engine-{self._next_id}"
        self._next_id += 1
        slot = min(set(range(len(self._slot_cores))) - set(self._slots.values()), default=0)
        self._slots[name] = slot
        address = f"{self.host}:{find_free_port(self.host)}"
        env = openmp_wait_env(os.environ)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.threads_per_replica)
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        metrics_port = find_free_port(self.host)
        argv = [*self.engine_argv, "--replica-id", name, "--port", address.rsplit(":", 1)[1],
                "--metrics-port", str(metrics_port)]
        child = ChildProcess(name, argv, log_path, self.echo_logs, env, cpus=self._slot_cores[slot])
        self.supervisor.add(child, lambda: _serving(address, self.tls))
        log.info("starting replica %s at %s on cores %s (metrics on port %d)", name, address,
                 sorted(self._slot_cores[slot]), metrics_port)

    def close(self, timeout_s: float | None = None) -> None:
        """Drains every replica (SIGTERM) and waits for them to exit; SIGKILL after the grace."""
        children = [status.child for status in self.supervisor.children()]
        for child in children:
            self.supervisor.retire(child.name)
        deadline = time.monotonic() + (self.supervisor.retire_grace_s if timeout_s is None else timeout_s)
        self.supervisor.stop()
        for child in children:
            child.wait_or_kill(deadline)

