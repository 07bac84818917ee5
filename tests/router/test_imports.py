"""The router and the gateway must not pull in torch or transformers (DESIGN.md: only engines do)."""

import subprocess
import sys


def test_router_and_gateway_import_neither_torch_nor_transformers():
    code = (
        "import sys\n"
        "import services.router.__main__, services.router.server, services.common.telemetry\n"
        "import services.gateway.__main__, services.gateway.app\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
