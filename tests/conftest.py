"""Fixtures shared across the test suite. Append new fixtures in clearly named functions."""

import os

import pytest

# Tests start service processes (fork + exec) while this process holds gRPC channels and servers.
# gRPC's fork handlers would then run in the child between fork and exec and can abort it; nothing
# here forks without exec, so they are turned off before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def _torch_sees_a_gpu() -> bool:
    try:
        import torch
    except ImportError:  # the base install (tokenizer, router, gateway): no kernels to run
        return False
    return torch.cuda.is_available()


# Where torch sees no GPU, the Triton kernels run in Triton's interpreter (read when triton is first
# imported; the engines the tests start inherit it); on a GPU they run compiled, as they serve.
if not _torch_sees_a_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' NATS servers (tests/processes.py) require this token, as `strata up`'s do, and every
# engine, router and autoscaler a test starts inherits it from here.
os.environ.setdefault("STRATA_NATS_TOKEN", "strata-tests-" + os.urandom(8).hex())

from services.common.ports import find_free_port  # noqa: E402
from services.common.supervisor import ChildProcess  # noqa: E402
from services.default_model.model import ensure_default_model  # noqa: E402 (after the environment above)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The built-in default checkpoint, built once per session in a temporary cache (not ~/.cache)."""
    return ensure_default_model(tmp_path_factory.mktemp("strata-cache"))


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


# The `slow` marker, kept honest: a test that starts a service process (the launcher's ChildProcess:
# tests/processes.py and `Stack` both start theirs with it) and is not marked slow fails, so that
# `-m "not slow"` stays a loop of seconds.
_num_spawned = 0
_spawn = ChildProcess.spawn


def _counted_spawn(self: ChildProcess) -> None:
    global _num_spawned
    _num_spawned += 1
    _spawn(self)


ChildProcess.spawn = _counted_spawn
_SPAWNED_BEFORE = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_SPAWNED_BEFORE] = _num_spawned
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "call" and report.passed and item.get_closest_marker("slow") is None:
        started = _num_spawned - item.stash.get(_SPAWNED_BEFORE, _num_spawned)
        if started:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} started {started} service process(es) but is not marked slow: "
                               "mark it @pytest.mark.slow (or its module: pytestmark = pytest.mark.slow)")
