"""`strata generate` (services/engine/offline.py): flags and requests the engine refuses end it with the engine's
reason on one line, not a traceback."""

import pytest

from services.engine import offline


def test_refused_flags_end_it_with_the_reason(default_model_dir):
    model = ["--model", str(default_model_dir), "--prompt", "hi"]
    with pytest.raises(SystemExit, match=r"^strata generate: --quantization int8: .*serve the model in bfloat16"):
        offline.main(model + ["--quantization", "int8", "--dtype", "float32"])
    with pytest.raises(SystemExit, match=r"^strata generate: --quantization fp8: .* is not quantized"):
        offline.main(model + ["--quantization", "fp8"])


@pytest.mark.parametrize("flags, reason", [
    (["--max-tokens", "-1"], "max_tokens must be at least 1"),
    (["--temperature", "-1"], "temperature must be non-negative"),
    (["--max-model-len", "8", "--max-tokens", "4"], "This model.s maximum context length is 8 tokens"),
])
def test_a_request_the_engine_refuses_ends_it_with_the_reason_before_anything_runs(default_model_dir, flags, reason):
    argv = ["--model", str(default_model_dir), "--prompt", "a prompt of more than a few tokens, surely"]
    with pytest.raises(SystemExit, match=rf"^strata generate: {reason}"):
        offline.main(argv + flags)
