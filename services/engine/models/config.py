"""The model settings the engine needs, parsed from a Hugging Face ``config.json``."""

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common import checkpoint_facts
from services.engine.models.quantized_weights import check_supported

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
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
    layer_sliding_windows: tuple[int | None, ...]  # per layer: the keys a query sees, itself included; None: all
    checkpoint_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...]
    quantization: dict | None = None  # config.json's quantization_config: its weights are dequantized at load

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The context length to serve: ``max_position_embeddings`` (the longest sequence, rope scaling
        included: `checkpoint_facts.max_model_len`) unless a shorter one is requested."""
        if requested is None:
            return self.max_position_embeddings
        if requested > self.max_position_embeddings:
            raise ValueError(f"--max-model-len {requested} exceeds the model's longest sequence "
                             f"{self.max_position_embeddings} (max_position_embeddings, and its rope scaling); "
                             f"lower it")
        return requested

    def resolve_dtype(self, dtype: str, device: torch.device | str) -> torch.dtype:
        """``auto`` takes the checkpoint's dtype (float32 when it names none), but bfloat16 for a float16
        checkpoint on the CPU, as vLLM's CPU backend: the engine's native CPU kernels run float32 and
        bfloat16 only, and float16 through torch decoded ~7x slower than bfloat16 (the small shape, 2
        cores). ``--dtype float16`` still runs float16."""
        if dtype == "auto":
            checkpoint = self.checkpoint_dtype or torch.float32
            if checkpoint == torch.float16 and torch.device(device).type == "cpu":
                log.info("the checkpoint is float16: on the CPU it runs in bfloat16 (--dtype auto); "
                         "--dtype float16 keeps float16, which decodes several times slower here")
                return torch.bfloat16
            return checkpoint
        if dtype not in _CHECKPOINT_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_CHECKPOINT_DTYPES)} or auto")
        return _CHECKPOINT_DTYPES[dtype]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json`` of a checkpoint directory; its eos ids and longest sequence are
    `checkpoint_facts`' (shared with the tokenizer service)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory")
    hf = checkpoint_facts.read_json(config_path)
    architectures = hf.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(f"unsupported architecture {architectures or hf.get('model_type')!r} in {config_path}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} in {config_path}; only silu is supported")

    check_supported(hf.get("quantization_config"), str(config_path))

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
        max_position_embeddings=checkpoint_facts.max_model_len(model_dir),
        rope=_parse_rope(hf, config_path),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias and not is_qwen2,
        mlp_bias=is_llama and bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layer_sliding_windows=_parse_sliding_windows(hf, architecture, config_path),
        checkpoint_dtype=_CHECKPOINT_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype")),
        eos_token_ids=checkpoint_facts.eos_token_ids(model_dir),
        quantization=hf.get("quantization_config"),
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
    if rope_type in ("llama3", "yarn", "dynamic"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor is not supported ({config_path})")
    return RopeConfig(rope_type=rope_type, theta=float(theta), params=params)


def _parse_sliding_windows(hf: dict, architecture: str, config_path: Path) -> tuple[int | None, ...]:
    """Which layers attend through a sliding window, as transformers decides it: every Mistral layer when
    ``sliding_window`` is set (4096 when the key is absent); for Qwen2, only with ``use_sliding_window``,
    the layers that ``layer_types`` names ``sliding_attention`` (by default those from
    ``max_window_layers`` on); never for Llama."""
    num_layers = hf["num_hidden_layers"]
    if architecture == "MistralForCausalLM":
        window = hf.get("sliding_window", 4096)
        return (int(window) if window else None,) * num_layers
    if architecture != "Qwen2ForCausalLM" or not hf.get("use_sliding_window", False) or not hf.get("sliding_window", 4096):
        return (None,) * num_layers
    window = int(hf.get("sliding_window", 4096))
    first_sliding = hf.get("max_window_layers", 28)
    layer_types = hf.get("layer_types") or ["sliding_attention" if i >= first_sliding else "full_attention"
                                            for i in range(num_layers)]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if len(layer_types) != num_layers or unknown:
        raise ValueError(f"layer_types in {config_path} must name sliding_attention or full_attention for each "
                         f"of the {num_layers} layers")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
