"""Random-weight checkpoints for benchmarks: a Llama of a shared shape, servable as is."""

import shutil
from pathlib import Path

# Shapes shared by the project's benchmarks (shared/bench/models.json), Llama architecture.
SHAPES = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=688, vocab_size=4096, max_position_embeddings=2048),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1376, vocab_size=8192, max_position_embeddings=4096),
    "medium": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                   intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096),
    # GPU only: ~16 GB of bfloat16 weights (write it with dtype="bfloat16", device="cuda")
    "llama3-8b-shape": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                            rope_theta=500000.0),
}


def write_random_llama(directory: Path, shape: str, seed: int = 0, servable: bool = False, dtype: str = "float32",
                       device: str = "cpu") -> Path:
    """Writes a random-weight Llama of `shape` in `dtype`, its weights drawn on `device` as
    transformers initialises them (normal with std ``initializer_range``, norms at one).
    `servable` adds the built-in model's tokenizer files and sizes the vocabulary to that tokenizer's,
    so the whole stack can serve it (a model that samples ids the tokenizer cannot decode cannot be
    served)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from services.default_model.model import VOCAB_SIZE, ensure_default_model

    fields = dict(SHAPES[shape], vocab_size=VOCAB_SIZE) if servable else SHAPES[shape]
    config = LlamaConfig(**fields, dtype=dtype, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, size in shapes.items():  # one tensor at a time on the device, kept on the CPU
        if name.endswith("norm.weight"):
            tensor = torch.ones(size, dtype=getattr(torch, dtype))
        else:
            tensor = torch.empty(size, device=device).normal_(0.0, config.initializer_range, generator=generator)
        weights[name] = tensor.to(getattr(torch, dtype)).cpu()
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file(weights, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    if servable:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(ensure_default_model() / name, Path(directory) / name)
    return Path(directory)
