"""Build a model from a Hugging Face checkpoint directory and fill it from its weight files."""

import logging
from pathlib import Path

import torch

from services.engine.attention.base import AttentionBackend
from services.engine.models import int8_linear
from services.engine.models.checkpoint_tensors import CheckpointTensors
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.packed_linear import blocked_weights_onto_huge_pages, can_pack
from services.engine.models.quantized_weights import INT8_AT_LOAD, QuantizedWeights, describe

log = logging.getLogger(__name__)


def load_model(model_dir: str | Path, config: ModelConfig, attention: AttentionBackend, max_positions: int,
               dtype: torch.dtype, device: torch.device, int8_weights: bool = False) -> LlamaForCausalLM:
    """One implementation serves the three supported architectures. Checkpoint tensors that the model
    has no parameter for (``rotary_emb.inv_freq``, a tied ``lm_head.weight``) are ignored; a missing one
    raises ``ValueError`` naming it. On the CPU the projections are then prepacked for oneDNN and the
    native kernels, or with ``int8_weights`` rounded to int8 for them (``int8_linear``)."""
    if int8_weights and (reason := int8_linear.unsupported_reason(device, dtype)) is not None:
        raise ValueError(f"--quantization {INT8_AT_LOAD}: {reason}")
    model_dir = Path(model_dir)
    weights = QuantizedWeights(CheckpointTensors(model_dir), config.quantization)
    if config.quantization:
        log.info("quantized checkpoint, %s: its weights are dequantized to %s as they load (no low-bit kernels: "
                 "memory and speed as an unquantized checkpoint's)", describe(config.quantization),
                 str(dtype).removeprefix("torch."))
    model = LlamaForCausalLM(config, attention, max_positions, dtype, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for param_name, sources in model.checkpoint_sources().items():
            parts = [weights.get(source) for source in sources]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
            param = params[param_name]
            if tensor.shape != param.shape:
                raise ValueError(f"checkpoint tensor {sources} has shape {tuple(tensor.shape)}, "
                                 f"the config implies {tuple(param.shape)}")
            param.copy_(tensor)
    model.eval().requires_grad_(False)
    if int8_weights:
        model.pack_linears(int8=True)
        blocked_weights_onto_huge_pages(model)
    elif can_pack(device, dtype):
        model.pack_linears()
        blocked_weights_onto_huge_pages(model)
    return model

