"""The tokenizer under hostile input, on the real service (issue: a 194-byte template of nested
loops froze it for 22 s, `{{ 'x' * 10000000 }}` grew it by 1.7 GB, a 4 MB prompt froze every
stream for 2.5 s): request templates are refused unless trusted; when trusted, those templates are
refused within about a second, memory stays bounded and health answers throughout; a 4 MB prompt
does not hold up a small request; an 8 MB prompt is not refused by a gRPC size limit."""

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import tokenizer_pb2 as pb
from services.common.pb import tokenizer_pb2_grpc
from tests.processes import TokenizerProcess

pytestmark = pytest.mark.slow  # starts tokenizer processes

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TEN_MILLION = "{{ 'x' * 10000000 }}"
DOUBLING = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
HI = [pb.ChatMessage(role="user", content="hi")]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def untrusting_server(default_model_dir, free_port_factory, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("logs") / "tokenizer-untrusting.log"
    with TokenizerProcess(default_model_dir, free_port_factory(), log_path) as server:
        server.wait_serving()
        yield server


def test_a_request_template_is_refused_by_default(untrusting_server):
    request = pb.EncodeChatRequest(messages=HI, chat_template="{{ messages[0].content }}")
    with pytest.raises(grpc.RpcError) as refused:
        untrusting_server.stub.EncodeChat(request, timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--trust-request-chat-template" in refused.value.details()
    named = pb.EncodeChatRequest(messages=HI, chat_template="default")  # the model's own, by name
    assert untrusting_server.stub.EncodeChat(named, timeout=5).token_ids


class HealthWatch:
    """Polls health every 50 ms on its own channel; keeps the slowest answer."""

    def __init__(self, address: str) -> None:
        self.slowest = 0.0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    self.failures += status != health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    self.failures += 1
                self.slowest = max(self.slowest, time.monotonic() - started)
                time.sleep(0.05)  # the watch's pace

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


ATTACKS = [line for line in (Path(__file__).parent / "hostile_templates.txt").read_text().splitlines() if line]


@pytest.mark.parametrize("template", [NESTED_LOOPS, TEN_MILLION, DOUBLING, *ATTACKS])
def test_a_hostile_template_is_stopped_within_a_second(default_server, template):
    address = default_server.address
    before = rss_mib(default_server.process.pid)
    watch = HealthWatch(address)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        default_server.stub.EncodeChat(pb.EncodeChatRequest(messages=HI, chat_template=template), timeout=10)
    took = time.monotonic() - started
    watch.stop()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert took < 1.5, f"refused after {took:.2f} s"
    assert watch.failures == 0 and watch.slowest < 0.5, (watch.failures, watch.slowest)
    assert rss_mib(default_server.process.pid) - before < 200


def test_a_4mb_prompt_does_not_hold_up_a_small_request(default_server):
    big = "lorem ipsum dolor sit amet " * (4 * 1024 * 1024 // 27)
    small_times = []

    def small_requests() -> None:  # another client, on its own connection
        with grpc.insecure_channel(default_server.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            stub.Encode(pb.EncodeRequest(text="warm up"), timeout=10)
            for _ in range(20):
                started = time.monotonic()
                stub.Encode(pb.EncodeRequest(text="hello there"), timeout=10)
                small_times.append(time.monotonic() - started)
                time.sleep(0.02)  # spread over the big request's time

    thread = threading.Thread(target=small_requests)
    thread.start()
    ids = default_server.stub.Encode(pb.EncodeRequest(text=big), timeout=60).token_ids
    thread.join()
    assert len(ids) > 100_000
    assert max(small_times) < 0.2, f"a small request waited {max(small_times):.3f} s beside the 4 MB prompt"


def test_an_8mb_prompt_fits_the_grpc_limits(default_server):
    text = "ab " * (8 * 1024 * 1024 // 3)
    assert len(default_server.stub.Encode(pb.EncodeRequest(text=text), timeout=120).token_ids) > 0
