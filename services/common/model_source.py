"""``--model`` as vLLM takes it: a local checkpoint directory, or a Hugging Face Hub id ("org/name")
found in the local Hugging Face cache, or downloaded into it.

A Hub id resolves through ``huggingface_hub`` (its cache is ``HF_HUB_CACHE`` or ``HF_HOME``/hub,
``~/.cache/huggingface/hub`` by default; ``HF_HUB_OFFLINE=1`` keeps it to what is cached; ``HF_TOKEN``
for gated models): only what serving reads is fetched (configs, safetensors weights, or the PyTorch
``.bin`` ones where a repository has no safetensors, tokenizer files, chat templates). The served
model's name stays the id, as vLLM names it.
"""

import logging
from pathlib import Path

log = logging.getLogger(__name__)

_SERVING_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "additional_chat_templates/*"]
_PICKLED_WEIGHTS = ["*.json", "pytorch_model*.bin"]


def resolve_model_dir(model: str) -> str:
    """The local directory of ``model``: itself when it is one, else the Hub id's snapshot in the cache
    (downloaded there unless offline). ValueError saying what to do when neither works."""
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ValueError(f"--model {model} is a file; it takes a Hugging Face checkpoint directory (config.json, "
                         f"weights, tokenizer files) or a Hub id (GGUF files are not served)")
    if not _looks_like_hub_id(model):
        raise ValueError(f"--model {model}: no such directory (pass a checkpoint directory or a Hugging Face "
                         f"Hub id such as Qwen/Qwen2.5-0.5B-Instruct)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise ValueError(f"--model {model} is not a directory, and huggingface_hub (which finds Hub ids in the "
                         f"Hugging Face cache) is not installed: pip install huggingface_hub, or pass a "
                         f"checkpoint directory") from None
    try:
        snapshot = Path(snapshot_download(model, allow_patterns=_SERVING_FILES))
        if not any(snapshot.glob("*.safetensors")) and not (snapshot / "model.safetensors.index.json").is_file():
            snapshot = Path(snapshot_download(model, allow_patterns=_PICKLED_WEIGHTS))
    except (LocalEntryNotFoundError, HFValidationError) as error:
        raise ValueError(f"--model {model}: not in the Hugging Face cache and not downloadable here ({error}); "
                         f"download it with `hf download {model}` where there is network, or pass a checkpoint "
                         f"directory") from None
    except Exception as error:  # noqa: BLE001 (network errors, a repository that does not exist or is gated)
        raise ValueError(f"--model {model}: could not fetch it from the Hugging Face Hub: {error}") from None
    log.info("model %s: %s", model, snapshot)
    return str(snapshot)


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not model.startswith((".", "~")) and "\\" not in model
