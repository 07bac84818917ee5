"""The committed gRPC stubs are what the .proto files generate."""

import subprocess
import sys


def test_generated_stubs_are_fresh():
    result = subprocess.run(
        [sys.executable, "-m", "services.common.protogen", "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
