"""`strata generate` (services/engine/offline.py): flags the engine refuses end it with the engine's
reason on one line, not a traceback."""

import pytest

from services.engine import offline


def test_refused_flags_end_it_with_the_reason(default_model_dir):
    model = ["--model", str(default_model_dir), "--prompt", "hi"]
    with pytest.raises(SystemExit, match=r"^strata generate: --quantization int8: .*serve the model in bfloat16"):
        offline.main(model + ["--quantization", "int8", "--dtype", "float32"])
    with pytest.raises(SystemExit, match=r"^strata generate: --quantization fp8: .* is not quantized"):
        offline.main(model + ["--quantization", "fp8"])
