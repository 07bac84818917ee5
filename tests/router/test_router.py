"""The router as a real process in front of two engine processes, following their KV events on a
real NATS server: a prompt's prefix pulls its requests to the replica that cached it, distinct
requests spread over both, an engine's refusal passes through as it is, and when a replica dies
its requests go to the other one without the client seeing an error, also when it hangs (paused)
rather than dies."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import engine_pb2, engine_pb2_grpc
from tests.engine.test_engine_server import EngineProcess, generate_request
from tests.nats_server import NatsServer


class RouterProcess:
    def __init__(self, port: int, engine_addrs: list[str], nats_url: str, log_path, metrics_port: int,
                 check_interval_s: float = 60, extra_args: tuple[str, ...] = ()) -> None:
        self.log_path = log_path
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.router", "--port", str(port), "--engine-addrs", ",".join(engine_addrs),
                 "--nats-url", nats_url, "--health-check-interval", str(check_interval_s),
                 "--metrics-port", str(metrics_port), *extra_args],
                stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def wait_serving(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                if self.health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise TimeoutError(self.log_path.read_text())

    def close(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(timeout=20)


@pytest.fixture(scope="module")
def fleet(default_model_dir, tmp_path_factory, free_port_factory):
    logs = tmp_path_factory.mktemp("fleet")
    nats = NatsServer(free_port_factory())
    engines = {}
    for name in ("e0", "e1"):
        port = free_port_factory()
        engines[name] = EngineProcess(default_model_dir, port, logs / f"{name}.log",
                                      ("--replica-id", name, "--nats-url", nats.url, "--load-report-interval", "0.2"))
        engines[name].address = f"127.0.0.1:{port}"
    for engine in engines.values():
        engine.wait_serving()
    router = RouterProcess(free_port_factory(), [e.address for e in engines.values()], nats.url, logs / "router.log",
                           free_port_factory())
    router.wait_serving()
    deadline = time.monotonic() + 10  # both replicas checked healthy, not only the first
    while router.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5).num_kv_blocks < 512:
        assert time.monotonic() < deadline, router.log_path.read_text()
        time.sleep(0.1)
    router.nats_url = nats.url
    yield router, engines
    router.close()
    for engine in engines.values():
        engine.close()
    nats.stop()


def served_by(router, request_id, prompt, max_tokens=2) -> str:
    outputs = list(router.stub.Generate(generate_request(request_id, prompt, max_tokens, temperature=0.0), timeout=60))
    assert sum(len(o.token_ids) for o in outputs) == max_tokens
    return outputs[-1].replica_id


def test_info_and_load_speak_for_the_fleet(fleet):
    router, _ = fleet
    info = router.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)
    assert info.replica_id == "router-0" and info.num_kv_blocks == 2 * 256 and info.vocab_size == 4096
    load = router.stub.Load(engine_pb2.LoadRequest(), timeout=5)
    assert load.num_kv_blocks_total == 2 * 256


def test_a_cached_prefix_pulls_its_requests_to_its_replica(fleet):
    router, _ = fleet
    shared = list(range(200, 264))  # four full blocks
    first = served_by(router, "p0", shared + [1])
    time.sleep(0.5)  # its KV events reach the router
    for i in range(1, 6):
        assert served_by(router, f"p{i}", shared + [i + 1, i + 2]) == first
    # Distinct prompts have no cache anywhere: equal cost, so they alternate.
    replicas = {served_by(router, f"d{i}", [300 + 17 * i + j for j in range(40)]) for i in range(6)}
    assert replicas == {"e0", "e1"}


def test_a_router_without_addresses_finds_the_engines_by_their_load_reports(fleet, tmp_path, free_port_factory):
    router, _ = fleet
    finder = RouterProcess(free_port_factory(), [], router.nats_url, tmp_path / "finder.log", free_port_factory(),
                           check_interval_s=0.2)
    try:
        finder.wait_serving()
        deadline = time.monotonic() + 20
        while finder.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5).num_kv_blocks < 512:
            assert time.monotonic() < deadline, finder.log_path.read_text()
            time.sleep(0.1)
        assert served_by(finder, "found", [11, 12, 13]) in {"e0", "e1"}
    finally:
        finder.close()


def test_an_engines_refusal_passes_through(fleet):
    router, _ = fleet
    with pytest.raises(grpc.RpcError) as error:
        list(router.stub.Generate(generate_request("bad", [999_999], 2), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in error.value.details()


def test_a_request_waiting_on_a_hung_replica_moves_when_its_health_checks_fail(fleet, tmp_path, free_port_factory):
    router, engines = fleet
    watcher = RouterProcess(free_port_factory(), [e.address for e in engines.values()], router.nats_url,
                            tmp_path / "watcher.log", free_port_factory(), check_interval_s=0.2,
                            extra_args=("--policy", "round-robin"))
    try:
        watcher.wait_serving()
        deadline = time.monotonic() + 20
        while watcher.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5).num_kv_blocks < 512:
            assert time.monotonic() < deadline, watcher.log_path.read_text()
            time.sleep(0.1)
        hung = engines["e1"].process
        os.kill(hung.pid, signal.SIGSTOP)  # it holds its connections but answers nothing
        try:
            # Round robin sends one of the first two there before a health check (1 s timeout) fails;
            # that request must move to e0 then, not wait on the paused process.
            served = [served_by(watcher, f"h{i}", [700 + i] * 20) for i in range(4)]
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        assert served == ["e0"] * 4
        assert metric_values(watcher)['strata:router_failovers_total{replica="e1"}'] == 1
    finally:
        watcher.close()


def test_requests_go_on_when_a_replica_dies(fleet):
    router, engines = fleet
    shared = list(range(500, 548))
    victim = served_by(router, "v0", shared)
    time.sleep(0.5)
    engines[victim].process.kill()
    engines[victim].process.wait(timeout=10)
    survivor = ({"e0", "e1"} - {victim}).pop()
    # The next request prefers the dead replica (its cache); the router has not checked it since (the
    # checks are a minute apart here), so the call fails before any token and the request moves over.
    assert served_by(router, "v1", shared + [7]) == survivor
    assert all(served_by(router, f"v{i}", [600 + i] * 20) == survivor for i in range(2, 6))
    metrics = metric_values(router)
    assert metrics[f'strata:router_failovers_total{{replica="{victim}"}}'] == 1
    assert metrics[f'strata:router_requests_total{{replica="{survivor}"}}'] >= 5
    assert metrics[f'strata:router_replica_healthy{{replica="{survivor}"}}'] == 1


def metric_values(router) -> dict[str, float]:
    text = urllib.request.urlopen(router.metrics_url, timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}
