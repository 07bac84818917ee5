"""The CPU allocator tuning keeps freed memory in the process; release_freed_memory hands it back
(in a child process, so this one's malloc settings stay as they were)."""

import subprocess
import sys

import pytest

CHILD = """
import os
from pathlib import Path
from services.engine.cpu_allocator import keep_freed_memory, release_freed_memory

def resident_mib():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

assert keep_freed_memory()
base = resident_mib()
blocks = [bytearray(1 << 20) for _ in range(256)]  # 256 MiB in 1 MiB blocks: heap memory, touched
del blocks
kept = resident_mib()
assert release_freed_memory()
released = resident_mib()
print(base, kept, released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning: Linux only")
def test_freed_memory_stays_until_released():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    base, kept, released = map(float, result.stdout.split())
    assert kept - base > 200, (base, kept, released)  # freed, but kept by the tuning
    assert released - base < 50, (base, kept, released)  # handed back
