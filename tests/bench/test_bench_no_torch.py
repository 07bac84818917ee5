import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # imports the bench modules in a new interpreter


def test_bench_modules_do_not_import_torch():
    code = ("import sys\n"
            "import services.bench.__main__, services.bench.serve, services.bench.compare, services.bench.plots\n"
            "services.bench.plots._pyplot()\n"
            "sys.exit('torch' in sys.modules)\n")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
