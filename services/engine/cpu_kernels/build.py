"""Builds and loads the engine's native CPU kernels: plain C++ with OpenMP, compiled once per machine
with the system's C++ compiler and loaded with ``ctypes``.

No torch headers and no pybind11: a kernel source compiles in seconds, the shared object is cached
on disk under a key of its source, the shared headers beside it (``*.h``), the compiler flags and this
CPU's instruction set, so a second start (or another replica) loads it at once. The kernels link the same GNU OpenMP runtime as
torch, so they share its thread pool.

Without a compiler, or when a build fails, ``load_library`` returns None once with a warning, and the
caller keeps its pure-torch path.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno")
_DISABLE_ENV = "STRATA_DISABLE_CPU_KERNELS"  # "1": never build or load them (the torch path everywhere)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    root = os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root) / "cpu_kernels"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def load_library(source_name: str) -> ctypes.CDLL | None:
    """The compiled ``SOURCE_DIR/source_name`` (a ``.cpp`` file), built on first use; None when native
    kernels are disabled or cannot be built here (logged once per source)."""
    with _lock:
        if source_name not in _loaded:
            _loaded[source_name] = _build_and_load(SOURCE_DIR / source_name)
        return _loaded[source_name]


def load_function(source_name: str, symbol: str, argtypes: list, restype=None):
    """The C function ``symbol`` of ``load_library(source_name)`` with its argument and result types
    set, or None where the library is not built here."""
    library = load_library(source_name)
    if library is None:
        return None
    function = getattr(library, symbol)
    function.argtypes, function.restype = argtypes, restype
    return function


def _build_and_load(source: Path) -> ctypes.CDLL | None:
    if os.environ.get(_DISABLE_ENV) == "1":
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found (g++, c++, clang++ or $CXX): native CPU kernels are off, "
                    "the engine runs its slower pure-torch path")
        return None
    key = _cache_key(source, cxx)
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: replicas starting together never load a half-written file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            result = subprocess.run([cxx, *CFLAGS, str(source), "-o", str(partial)], capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("building native CPU kernel %s failed, using the pure-torch path:\n%s",
                            source.name, result.stderr[-4000:])
                return None
            os.replace(partial, target)
    return ctypes.CDLL(str(target))


def _cache_key(source: Path, cxx: str) -> str:
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    for header in sorted(SOURCE_DIR.glob("*.h")):  # the kernels' shared headers
        digest.update(header.read_bytes())
    digest.update(" ".join((cxx, *CFLAGS)).encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (``-march=native`` code runs only where they hold)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
