"""A checkpoint directory's tensors by name, whatever files hold them.

Hugging Face checkpoints come as safetensors (``model.safetensors``, or shards named by
``model.safetensors.index.json``) or, older ones, as PyTorch pickles (``pytorch_model.bin``, or shards
named by ``pytorch_model.bin.index.json``), as vLLM's ``--load-format auto`` reads them: safetensors
when there are any. Pickles are read with ``weights_only`` (no code runs) and memory-mapped, so a
tensor costs memory only when it is read."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

_FORMATS = (  # (single file, index of shards), in the order they are looked for
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


class CheckpointTensors:
    """``name in tensors`` and ``tensors.get(name)``; files open on first use, for the object's life."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._open: dict[Path, object] = {}
        self._file_of = self._tensor_files()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise ValueError(f"checkpoint {self.model_dir} is missing tensor {name!r}")
        opened = self._opened(self._file_of[name])
        return opened[name] if isinstance(opened, dict) else opened.get_tensor(name)

    def _tensor_files(self) -> dict[str, Path]:
        """Tensor name → the file that holds it."""
        for single, index in _FORMATS:
            if (self.model_dir / index).is_file():
                weight_map = json.loads((self.model_dir / index).read_text())["weight_map"]
                return {name: self.model_dir / file for name, file in weight_map.items()}
            if (self.model_dir / single).is_file():
                return dict.fromkeys(self._opened(self.model_dir / single).keys(), self.model_dir / single)
        raise ValueError(f"{self.model_dir} has no weights: neither model.safetensors (or its index "
                         f"model.safetensors.index.json) nor pytorch_model.bin (or pytorch_model.bin.index.json)")

    def _opened(self, path: Path):
        if path not in self._open:
            self._open[path] = _open(path)
        return self._open[path]


def _open(path: Path):
    if path.suffix == ".safetensors":
        return safe_open(path, framework="pt")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
