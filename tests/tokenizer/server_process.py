"""Runs the real tokenizer service as a subprocess on loopback, for tests that go through gRPC."""

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import tokenizer_pb2_grpc


class TokenizerProcess:
    def __init__(self, process: subprocess.Popen, channel: grpc.Channel, log_path: Path) -> None:
        self.process = process
        self.channel = channel
        self.log_path = log_path
        self.stub = tokenizer_pb2_grpc.TokenizerStub(channel)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def tokenizer_server(
    model_dir: Path | None, port: int, log_path: Path, env: dict[str, str] | None = None, timeout_s: float = 60.0,
    extra_args: tuple[str, ...] = (),
) -> Iterator[TokenizerProcess]:
    """Starts `python -m services.tokenizer` (without --model when `model_dir` is None), waits for
    health SERVING, and SIGTERMs it afterwards unless the test already stopped it."""
    model_args = [] if model_dir is None else ["--model", str(model_dir)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.tokenizer", *model_args, "--port", str(port), *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20),
                                                                  ("grpc.max_send_message_length", 64 << 20)])
    server = TokenizerProcess(process, channel, log_path)
    try:
        _wait_until_serving(server, timeout_s)
        yield server
    finally:
        channel.close()
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=30)


def _wait_until_serving(server: TokenizerProcess, timeout_s: float) -> None:
    health = health_pb2_grpc.HealthStub(server.channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"tokenizer exited with {server.process.returncode}:\n{server.log()}")
        try:
            response = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"tokenizer not SERVING after {timeout_s}s:\n{server.log()}")
