"""Build a model from a Hugging Face checkpoint directory and fill it from its safetensors files."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.attention.base import AttentionBackend
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.packed_linear import blocked_weights_onto_huge_pages, can_pack


def load_model(model_dir: str | Path, config: ModelConfig, attention: AttentionBackend, max_positions: int,
               dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """One implementation serves the three supported architectures. Checkpoint tensors that the model
    has no parameter for (``rotary_emb.inv_freq``, a tied ``lm_head.weight``) are ignored; a missing one
    raises ``ValueError`` naming it. On the CPU the projections are then prepacked for oneDNN."""
    model_dir = Path(model_dir)
    tensor_files = _tensor_files(model_dir)
    model = LlamaForCausalLM(config, attention, max_positions, dtype, device)
    params = dict(model.named_parameters())
    handles = {}
    with torch.no_grad():
        for param_name, sources in model.checkpoint_sources().items():
            parts = []
            for source in sources:
                if source not in tensor_files:
                    raise ValueError(f"checkpoint {model_dir} is missing tensor {source!r}")
                path = tensor_files[source]
                if path not in handles:
                    handles[path] = safe_open(path, framework="pt")
                parts.append(handles[path].get_tensor(source))
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
            param = params[param_name]
            if tensor.shape != param.shape:
                raise ValueError(f"checkpoint tensor {sources} has shape {tuple(tensor.shape)}, "
                                 f"the config implies {tuple(param.shape)}")
            param.copy_(tensor)
    model.eval().requires_grad_(False)
    if can_pack(device, dtype):
        model.pack_linears()
        blocked_weights_onto_huge_pages(model)
    return model


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it, for a single file or a sharded checkpoint."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)
