"""Random-weight Hugging Face checkpoints for tests: tiny Llama, Qwen2 and Mistral models."""

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, initializer_range=0.15,
            eos_token_id=2, bos_token_id=1)


def write_checkpoint(directory: str | Path, arch: str, *, legacy_rope: bool = False, max_shard_size: str | None = None,
                     seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Write a random checkpoint (float32 unless ``dtype``) of ``arch`` ("llama" | "qwen2" | "mistral")
    into ``directory``.

    ``overrides`` are config fields on top of the tiny defaults (e.g. ``head_dim``, ``rope_scaling``,
    ``tie_word_embeddings``, or the shapes of ``shared/bench/models.json``). ``legacy_rope`` rewrites
    the config in the pre-transformers-5 form (top-level ``rope_theta`` and ``rope_scaling``);
    ``max_shard_size`` (e.g. "100KB") writes a sharded checkpoint with an index.
    """
    config_cls, model_cls = _ARCHS[arch]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    directory = Path(directory)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    if legacy_rope:
        _rewrite_legacy_rope(directory / "config.json")
    return directory


def _rewrite_legacy_rope(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config_path.write_text(json.dumps(config, indent=2))
