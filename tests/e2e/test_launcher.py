"""`strata up` machinery: a service that dies during startup is named with the tail of its log,
and nothing is left running."""

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import httpx
import openai
import pytest

from services.common.pb import engine_pb2, engine_pb2_grpc
from services.engine.threads import OPENMP_BINDING_VARIABLES
from services.launcher import (
    Stack,
    StackConfig,
    StartupError,
    engine_flags,
    find_free_port,
    gateway_flags,
    parse_args,
    tokenizer_flags,
)


def test_a_service_that_dies_at_startup_is_named_with_its_log(tmp_path):
    config = StackConfig(model=str(tmp_path / "no-such-checkpoint"), port=find_free_port(),
                         log_dir=tmp_path / "logs", echo_logs=False, startup_timeout_s=60, grace_s=2)
    stack = Stack(config)
    with pytest.raises(StartupError) as info:
        stack.start()
    message = str(info.value)
    assert "exited with code" in message and "last lines of its log" in message
    assert any(f"the {name} exited" in message for name in ("tokenizer", "engine", "gateway"))
    assert all(service.exit_code is not None for service in stack.services), "orphans left"
    assert (tmp_path / "logs" / "tokenizer.log").exists()


def test_an_engine_that_refuses_its_flags_stops_the_stack_with_its_reason(default_model_dir, tmp_path):
    """The tokenizer starts; the engine does not load (a default no request could use) and exits, so
    `strata up` stops at once naming it, instead of waiting for an engine that would never serve."""
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), log_dir=tmp_path / "logs",
                         engine_args=["--override-generation-config", '{"top_p": 0}'], echo_logs=False,
                         startup_timeout_s=120, grace_s=2)
    stack = Stack(config)
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        stack.start()
    assert "the engine exited with code 1" in str(info.value) and "top_p must be in (0, 1]" in str(info.value)
    assert time.monotonic() - started < 60
    assert all(service.exit_code is not None for service in stack.services), "orphans left"


def test_engine_flags_pass_through():
    args = parse_args(["--max-num-seqs", "8", "--dtype", "float32", "--no-enable-prefix-caching",
                       "--engine-args", "--block-size 32 --seed 3"])
    assert engine_flags(args) == ["--max-num-seqs", "8", "--dtype", "float32",
                                  "--no-enable-prefix-caching", "--block-size", "32", "--seed", "3"]
    vllm_style = parse_args(["--quantization", "awq", "--trust-remote-code"])
    assert engine_flags(vllm_style) == ["--quantization", "awq", "--trust-remote-code"]
    counts = parse_args(["--max-model-len", "32K", "--max-num-batched-tokens", "4k"])
    assert engine_flags(counts) == ["--max-num-batched-tokens", "4000", "--max-model-len", "32768"]
    assert engine_flags(parse_args(["--max-model-len", "auto"])) == []  # the engine's own choice
    vllm_flags = parse_args(["--enforce-eager", "--stream-interval", "4", "--tensor-parallel-size", "1",
                             "--kv-cache-dtype", "auto"])
    assert engine_flags(vllm_flags) == ["--enforce-eager", "--stream-interval", "4", "--tensor-parallel-size", "1",
                                        "--kv-cache-dtype", "auto"]


def test_gateway_flags_pass_through():
    args = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--gateway-args", "--max-n 4"])
    assert gateway_flags(args) == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-n", "4"]
    assert gateway_flags(parse_args([])) == []
    assert gateway_flags(parse_args(["--reasoning-parser", "deepseek_r1"])) == ["--reasoning-parser", "deepseek_r1"]
    assert gateway_flags(parse_args(["--allowed-origins", '["http://a"]', "--allow-credentials"])) == [
        "--allowed-origins", '["http://a"]', "--allow-credentials"]


def test_tokenizer_flags_pass_through():
    args = parse_args(["--chat-template", "t.jinja", "--trust-request-chat-template", "--tokenizer-args", "--workers 2"])
    assert tokenizer_flags(args) == ["--trust-request-chat-template", "--chat-template", "t.jinja", "--workers", "2"]
    assert tokenizer_flags(parse_args([])) == []


def test_log_flags_for_every_service():
    """`strata up --log-level/--log-format` go to every service, ahead of its own flags (which win);
    tests/e2e/test_tracing.py runs a whole stack with log_format="json"."""
    args = parse_args(["--log-format", "json", "--log-level", "DEBUG"])
    assert (args.log_format, args.log_level) == ("json", "debug")
    assert StackConfig(log_level="debug", log_format="json").log_flags() == ["--log-level", "debug",
                                                                            "--log-format", "json"]
    assert StackConfig().log_flags() == [] and parse_args([]).log_format is None


def test_replicas_behind_a_router(default_model_dir, tmp_path):
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), replicas=2,
                         engine_args=["--num-kv-blocks", "64", "--max-num-seqs", "4", "--enforce-eager"],
                         log_dir=tmp_path / "logs", echo_logs=False, startup_timeout_s=120, grace_s=5)
    with Stack(config) as stack:
        assert [s.name for s in stack.services] == ["tokenizer", "nats", "engine-0", "engine-1", "router", "gateway"]
        with grpc.insecure_channel(stack.engine_addr) as channel:  # the gateway's upstream is the router
            deadline = time.monotonic() + 60
            info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.EngineInfoRequest(), timeout=5)
            while info.num_kv_blocks < 128:  # until the router has checked both replicas
                assert time.monotonic() < deadline, info
                time.sleep(0.1)
                info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.EngineInfoRequest(), timeout=5)
        assert info.replica_id == "router-0"
        with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as client:
            for i in range(4):
                response = client.completions.create(model=stack.model_name, prompt=f"request {i}", max_tokens=3)
                assert response.usage.completion_tokens == 3
        for service in stack.services:  # each Python service, once ready (`services.common.gc_heap`)
            if service.name != "nats":
                assert "start-up objects frozen" in service.log_path.read_text(), service.name
    assert all(service.exit_code is not None for service in stack.services)


def test_the_container_health_probe(stack):
    probe = [sys.executable, "-m", "services.common.health_probe"]
    assert subprocess.run([*probe, stack.tokenizer_addr], timeout=30).returncode == 0
    assert subprocess.run([*probe, stack.engine_addr], timeout=30).returncode == 0
    assert subprocess.run([*probe, f"127.0.0.1:{find_free_port()}"], timeout=30).returncode == 1


def test_every_engine_the_router_and_the_tokenizer_get_their_own_metrics_port(default_model_dir, tmp_path):
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), replicas=2,
                         engine_args=["--num-kv-blocks", "64", "--max-num-seqs", "4", "--enforce-eager",
                                      "--metrics-port", "1"],  # one port for two replicas: replaced
                         log_dir=tmp_path / "logs", echo_logs=False, startup_timeout_s=120, grace_s=5)
    with Stack(config) as stack:
        assert set(stack.metrics_urls) == {"engine-0", "engine-1", "router", "tokenizer", "gateway"}
        assert len(set(stack.metrics_urls.values())) == 5
        for name in ("engine-0", "engine-1", "router", "tokenizer"):
            text = urllib.request.urlopen(stack.metrics_urls[name], timeout=5).read().decode()
            assert "strata:" in text, name


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice():
    """A service binds its port a moment after the launcher picked it; the kernel hands ports of the
    ephemeral range to outgoing connections meanwhile, so picks stay below it (Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    ports = [find_free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if ephemeral_start - 20_000 >= 1000:
        assert all(20_000 <= port < ephemeral_start for port in ports), ports


def test_a_hugging_face_hub_id_is_served_from_the_cache_under_its_id(default_model_dir, tmp_path):
    """`strata up --model org/name`, as vLLM takes a Hub id: found in the Hugging Face cache (offline
    here), served under the id."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--strata-test--tiny"
    (repo / "snapshots" / revision).mkdir(parents=True)
    for file in default_model_dir.iterdir():
        shutil.copy(file, repo / "snapshots" / revision / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    port = find_free_port()
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", "strata-test/tiny", "--port",
                           str(port), "--engine-args=--enforce-eager", "--log-dir", str(tmp_path / "logs")],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        models = None
        deadline = time.monotonic() + 120
        while models is None and time.monotonic() < deadline and up.poll() is None:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                models = response.json() if response.status_code == 200 else None
            except httpx.HTTPError:
                pass
            if models is None:
                time.sleep(0.5)
        assert models is not None, up.stdout.read() if up.poll() is not None else "not serving in 120 s"
        assert [m["id"] for m in models["data"]] == ["strata-test/tiny"]
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    missing = subprocess.run([sys.executable, "-m", "services.cli", "up", "--model", "strata-test/absent"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "not in the Hugging Face cache" in missing.stderr


def test_several_served_names_are_each_accepted_and_echoed(default_model_dir, tmp_path):
    """vLLM's --served-model-name a b: either name is served, /v1/models lists both, an answer carries the
    name its request sent (the first by default), and any other name is a 404."""
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), served_model_name="tiny",
                         served_model_aliases=["tiny-alias"], engine_args=["--enforce-eager"],
                         log_dir=tmp_path, echo_logs=False, startup_timeout_s=120)
    with Stack(config) as stack, openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]
        assert client.models.retrieve("tiny-alias").id == "tiny-alias"
        for name in ("tiny", "tiny-alias"):
            assert client.completions.create(model=name, prompt="Hi", max_tokens=1).model == name
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="Hi", max_tokens=1)
    assert parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_the_services_beside_one_cpu_engine_that_binds_keep_off_its_first_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    for name in ("OMP_NUM_THREADS", *OPENMP_BINDING_VARIABLES):
        monkeypatch.delenv(name, raising=False)

    def front_cores(engine_args: list[str], **config) -> set[int] | None:
        return Stack(StackConfig(model="m", engine_args=engine_args, **config)).front_cores

    assert front_cores([]) == {5, 6, 7}  # the engine binds thread i to core 4 + i; its first thread on 4
    assert front_cores(["--num-threads", "4", "--dtype", "float32"]) == {5, 6, 7}
    # where the engine does not bind its threads, the services go where the OS puts them
    assert front_cores(["--no-bind-threads"]) is None
    assert front_cores(["--num-threads", "2"]) is None
    assert front_cores(["--device", "cuda"]) is None
    assert front_cores(["--num-threads", "four"]) is None  # (the engine refuses the flag itself)
    assert front_cores([], replicas=2) is None
    monkeypatch.setenv("OMP_PROC_BIND", "close")  # the user's own OpenMP binding
    assert front_cores([]) is None
    monkeypatch.delenv("OMP_PROC_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert front_cores([]) is None  # one core: nowhere else to go


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_the_running_services_beside_the_engine_are_on_its_front_cores_in_every_thread(stack):
    def masks(pid: int) -> list[set[int]]:
        return [os.sched_getaffinity(int(task)) for task in os.listdir(f"/proc/{pid}/task")]

    front = stack.front_cores
    cores = os.sched_getaffinity(0)
    own_openmp = (any(name in os.environ for name in OPENMP_BINDING_VARIABLES)
                  or os.environ.get("OMP_NUM_THREADS", str(len(cores))) != str(len(cores)))  # the engine binds nothing
    assert front == (None if len(cores) < 2 or own_openmp else set(sorted(cores)[1:]))
    for service in stack.services:
        if service.name == "engine":
            assert os.sched_getaffinity(service.pid) == cores  # its main thread (bound only within a step)
        else:
            assert all(mask == (front or cores) for mask in masks(service.pid)), service.name


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_services_beside_the_engine_are_batch_scheduled_in_every_thread_and_the_engine_is_not(stack):
    def policies(pid: int) -> set[int]:
        return {os.sched_getscheduler(int(task)) for task in os.listdir(f"/proc/{pid}/task")}

    by_name = {service.name: policies(service.pid) for service in stack.services}
    assert by_name.pop("engine") == {os.SCHED_OTHER}  # its kernel threads and gRPC threads alike
    assert by_name and all(found == {os.SCHED_BATCH} for found in by_name.values()), by_name
