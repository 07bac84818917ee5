"""Fixtures shared across the test suite. Append new fixtures in clearly named functions."""

import os
import socket

# Tests start service processes (fork + exec) while this process holds gRPC channels and servers.
# gRPC's fork handlers would then run in the child between fork and exec and can abort it; nothing
# here forks without exec, so they are turned off before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Without a GPU, Triton kernels run in Triton's interpreter (read when triton is first imported).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' NATS servers (tests/nats_server.py) require this token, as `strata up`'s do, and every
# engine, router and autoscaler a test starts inherits it from here.
os.environ.setdefault("STRATA_NATS_TOKEN", "strata-tests-" + os.urandom(8).hex())

import pytest

from services.common.default_model import ensure_default_model


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The built-in default checkpoint, built once per session in a temporary cache (not ~/.cache)."""
    return ensure_default_model(tmp_path_factory.mktemp("strata-cache"))


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def free_port_factory():
    """`free_port_factory() -> int`, for session- or module-scoped fixtures that start servers."""
    return find_free_port


@pytest.fixture
def free_port() -> int:
    return find_free_port()


@pytest.fixture(scope="session")
def inductor_cache_dir(tmp_path_factory):
    """One torch.compile (inductor) cache for the session's compiled engines, not ~/.cache: a graph
    compiled by one test is loaded from disk by the next that needs the same shapes."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("inductor-cache")
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
        yield path
