"""Only engines need torch (DESIGN.md): the tokenizer (with the default-model builder), the router and
the gateway, the autoscaler (and `strata up`, which runs them) must not pull in torch or transformers."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # imports each service in a new interpreter

SERVICE_MODULES = {
    "tokenizer": ["services.tokenizer", "services.tokenizer.__main__", "services.tokenizer.server",
                  "services.default_model.model", "services.default_model.cli", "services.common.grpc_server"],
    "router": ["services.router.__main__", "services.router.server", "services.common.telemetry"],
    "gateway": ["services.gateway.__main__", "services.gateway.app"],
    "autoscaler": ["services.autoscaler.__main__", "services.autoscaler.service", "services.autoscaler.local_provider",
                   "services.launcher"],
}


@pytest.mark.parametrize("service", sorted(SERVICE_MODULES))
def test_service_imports_neither_torch_nor_transformers(service):
    code = (
        "import sys\n"
        + "".join(f"import {module}\n" for module in SERVICE_MODULES[service])
        + "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
