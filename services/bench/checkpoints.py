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
}


def write_random_llama(directory: Path, shape: str, seed: int = 0, servable: bool = False) -> Path:
    """Writes a float32 random-weight Llama of `shape`. `servable` adds the built-in model's
    tokenizer files and sizes the vocabulary to that tokenizer's, so the whole stack can serve it
    (a model that samples ids the tokenizer cannot decode cannot be served)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.default_model.model import VOCAB_SIZE, ensure_default_model

    torch.manual_seed(seed)
    fields = dict(SHAPES[shape], vocab_size=VOCAB_SIZE) if servable else SHAPES[shape]
    LlamaForCausalLM(LlamaConfig(**fields, torch_dtype="float32")).save_pretrained(directory)
    if servable:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(ensure_default_model() / name, Path(directory) / name)
    return Path(directory)
