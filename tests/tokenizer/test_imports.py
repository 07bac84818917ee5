"""The tokenizer service and the default-model builder must not pull in torch or transformers."""

import subprocess
import sys


def test_tokenizer_service_imports_neither_torch_nor_transformers():
    code = (
        "import sys\n"
        "import services.tokenizer, services.tokenizer.__main__, services.tokenizer.server\n"
        "import services.common.default_model, services.common.model_cli, services.common.grpc_server\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
