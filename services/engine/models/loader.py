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
    native kernels, or with ``int8_weights`` rounded to int8 for them (``int8_linear``); in bfloat16, a
    quantized checkpoint's int8 projections with a scale per row keep their integers (``_stored_int8``)."""
    if int8_weights and (reason := int8_linear.unsupported_reason(device, dtype)) is not None:
        raise ValueError(f"--quantization {INT8_AT_LOAD}: {reason}")
    model_dir = Path(model_dir)
    weights = QuantizedWeights(CheckpointTensors(model_dir), config.quantization)
    model = LlamaForCausalLM(config, attention, max_positions, dtype, device)
    stored_int8 = {}  # module name -> its integers and scales, kept as stored (not dequantized below)
    if not int8_weights and config.quantization and int8_linear.unsupported_reason(device, dtype) is None:
        stored_int8 = _stored_int8(model, weights)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for param_name, sources in model.checkpoint_sources().items():
            if param_name.removesuffix(".weight") in stored_int8:
                continue
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
        for name, (q, scales) in stored_int8.items():  # the others stay for pack_linears
            parent, _, attribute = name.rpartition(".")
            bias = model.get_submodule(name).bias
            setattr(model.get_submodule(parent), attribute, int8_linear.Int8Linear.of_integers(q, scales, bias))
        model.pack_linears()
        blocked_weights_onto_huge_pages(model)
    if config.quantization:
        _log_quantized(config.quantization, dtype, len(stored_int8))
    return model


def _stored_int8(model: LlamaForCausalLM, weights: QuantizedWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The projections the checkpoint stores as int8 with a scale per output row
    (``QuantizedWeights.int8_rows``; fused q/k/v and gate/up when all their parts are), by module name:
    their integers and scales, which the int8 kernels take as they are (bfloat16 on the CPU)."""
    stored = {}
    for param_name, sources in model.checkpoint_sources().items():
        if not param_name.endswith(".weight") or not isinstance(
                model.get_submodule(param_name.removesuffix(".weight")), torch.nn.Linear):
            continue
        parts = [weights.int8_rows(source.removesuffix(".weight")) for source in sources]
        if all(part is not None for part in parts):
            stored[param_name.removesuffix(".weight")] = (torch.cat([q for q, _ in parts]),
                                                          torch.cat([scale for _, scale in parts]))
    return stored


def _log_quantized(quantization: dict, dtype: torch.dtype, stored_int8: int) -> None:
    dtype_name = str(dtype).removeprefix("torch.")
    if stored_int8:
        log.info("quantized checkpoint, %s: its %d int8 projections run on the int8 kernels as stored (activations "
                 "in %s: half the memory and, at small batches, faster decoding); anything else is dequantized",
                 describe(quantization), stored_int8, dtype_name)
    else:
        log.info("quantized checkpoint, %s: its weights are dequantized to %s as they load (no kernels for its "
                 "format here: memory and speed as an unquantized checkpoint's)", describe(quantization), dtype_name)

