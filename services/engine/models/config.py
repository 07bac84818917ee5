"""The model settings the engine needs, parsed from a Hugging Face ``config.json``."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; ``params`` holds the type-specific keys (factor, low_freq_factor, ...)."""

    rope_type: str = "default"
    theta: float = 10000.0
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None  # None when every layer attends to the whole context
    checkpoint_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...]

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The context length to serve. Sliding-window attention is not implemented, so the default is
        capped at the window, and an explicit length beyond the window is rejected."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        if requested is None:
            return limit
        if requested > self.max_position_embeddings:
            raise ValueError(f"--max-model-len {requested} exceeds the model's max_position_embeddings "
                             f"{self.max_position_embeddings}; lower it")
        if self.sliding_window is not None and requested > self.sliding_window:
            raise ValueError(f"--max-model-len {requested} exceeds the model's sliding_window "
                             f"{self.sliding_window}, and sliding-window attention is not supported; "
                             f"use --max-model-len {self.sliding_window} or less")
        return requested

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """``auto`` takes the checkpoint's dtype (float32 when it names none)."""
        if dtype == "auto":
            return self.checkpoint_dtype or torch.float32
        if dtype not in _CHECKPOINT_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_CHECKPOINT_DTYPES)} or auto")
        return _CHECKPOINT_DTYPES[dtype]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for eos ids) of a checkpoint directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory")
    hf = json.loads(config_path.read_text())
    architectures = hf.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(f"unsupported architecture {architectures or hf.get('model_type')!r} in {config_path}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} in {config_path}; only silu is supported")

    num_heads = hf["num_attention_heads"]
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    is_llama = architecture == "LlamaForCausalLM"  # the only one of the three with bias switches
    attention_bias = is_qwen2 or (is_llama and bool(hf.get("attention_bias", False)))
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope=_parse_rope(hf, config_path),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias and not is_qwen2,
        mlp_bias=is_llama and bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=_parse_sliding_window(hf, is_qwen2),
        checkpoint_dtype=_CHECKPOINT_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype")),
        eos_token_ids=_parse_eos(hf, model_dir),
    )


def _parse_rope(hf: dict, config_path: Path) -> RopeConfig:
    """Both forms: transformers-5 ``rope_parameters`` and the older top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} in {config_path}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor is not supported ({config_path})")
    return RopeConfig(rope_type=rope_type, theta=float(theta), params=params)


def _parse_sliding_window(hf: dict, is_qwen2: bool) -> int | None:
    window = hf.get("sliding_window")
    if is_qwen2 and not hf.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _parse_eos(hf: dict, model_dir: Path) -> tuple[int, ...]:
    eos = None
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos = json.loads(generation_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
