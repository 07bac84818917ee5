"""The real stack (tokenizer + engine + gateway processes) started once per session with
``services.launcher.Stack``, and clients for it: the real `openai` client (max_retries=0 so a
retried status would show), httpx for raw HTTP, and gRPC stubs to look at the engine directly."""

from pathlib import Path

import grpc
import httpx
import openai
import pytest

from services.common.pb import engine_pb2, engine_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.launcher import Stack, StackConfig, StartupError, find_free_port

API_KEY = "sk-e2e-test"
MODEL = "strata-tiny-v1"
MAX_BODY_BYTES = 1_000_000
MAX_N = 4


def pytest_collection_modifyitems(items):
    """Every test here runs against real processes (this session's stack, or a stack of its own): all are slow."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def stack(default_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("stack-logs")
    config = StackConfig(
        model=str(default_model_dir), port=find_free_port(), served_model_name=MODEL, api_key=API_KEY,
        engine_args=["--max-num-seqs", "16", "--num-kv-blocks", "512", "--enforce-eager"],
        gateway_args=["--max-body-bytes", str(MAX_BODY_BYTES), "--max-n", str(MAX_N),
                      "--max-stop-strings", "4", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--log-level", "warning"],
        tokenizer_args=["--trust-request-chat-template"],  # tests bring their own templates
        log_dir=log_dir, echo_logs=False, startup_timeout_s=120, grace_s=5)
    yield from serving(config)


def serving(config: StackConfig):
    """A fixture's body: the stack started (a failed start fails the test, naming the service),
    yielded, then stopped with nothing left running."""
    stack = Stack(config)
    try:
        stack.start()
    except StartupError as error:
        pytest.fail(f"the stack did not start: {error}")
    yield stack
    stack.stop()
    for service in stack.services:
        assert service.exit_code is not None, f"{service.name} survived stop()"


@pytest.fixture(scope="session")
def client(stack) -> openai.OpenAI:
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def http(stack) -> httpx.Client:
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def engine(stack) -> engine_pb2_grpc.EngineStub:
    with grpc.insecure_channel(stack.engine_addr) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


@pytest.fixture(scope="session")
def tokenizer(stack) -> tokenizer_pb2_grpc.TokenizerStub:
    with grpc.insecure_channel(stack.tokenizer_addr) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)


def engine_load(engine) -> engine_pb2.LoadReport:
    return engine.Load(engine_pb2.LoadRequest(), timeout=5)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=text), timeout=5).token_ids)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids, skip_special_tokens=True),
                            timeout=5).text
