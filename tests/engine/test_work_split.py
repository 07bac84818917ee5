"""work_split.h's stealing (tests/engine/work_split_check.cpp): a thread that loses its core in the
middle of a run of work items holds nobody up. The run is taken over by the threads still running,
which go on through the next phases; no phase reads what an earlier one has not finished, and the
late thread's writes change nothing that is still read."""

import ctypes
import subprocess
from pathlib import Path

import pytest

from services.engine.cpu_kernels import build

CHECK = Path(__file__).with_name("work_split_check.cpp")


@pytest.fixture(scope="module")
def check_stealing(tmp_path_factory):
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    library = tmp_path_factory.mktemp("split") / "work_split_check.so"
    subprocess.run([cxx, *build.CFLAGS, f"-I{build.SOURCE_DIR}", str(CHECK), "-o", str(library)], check=True)
    function = ctypes.CDLL(str(library)).strata_check_stealing
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                         ctypes.POINTER(ctypes.c_int64)]
    function.restype = ctypes.c_int64
    return function


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("stall_phase", [0, 1, 2])
def test_a_stalled_run_is_taken_over_and_the_results_hold(check_stealing, threads, stall_phase):
    stolen = ctypes.c_int64()
    assert check_stealing(threads, 64, 8, stall_phase, 20_000, ctypes.byref(stolen)) == 0
    assert stolen.value >= 1  # the sleeping thread's run went to another thread


def test_without_a_stall_the_results_hold(check_stealing):
    stolen = ctypes.c_int64()
    for _ in range(20):
        assert check_stealing(2, 256, 40, -1, 0, ctypes.byref(stolen)) == 0
