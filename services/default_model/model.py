"""The built-in default checkpoint: a tiny random-weight Llama in Hugging Face format, built offline.

`ensure_default_model()` returns its directory, building it on first use; `ensure_model_at(DIR)`
builds it in a directory of one's choice. The build needs neither torch nor the network: the
tokenizer is a byte-level BPE trained with `tokenizers` on a corpus shipped beside this module, and
the weights are drawn with numpy from a fixed seed and written with `safetensors.numpy`. With the
same seed and library versions it writes the same bytes. The result loads in
`transformers.AutoTokenizer` and `AutoModelForCausalLM`; its text is nonsense, its shapes, tokenizer
and chat template are real.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

MODEL_NAME = "strata-tiny-v1"
SEED = 0
CORPUS_PATH = Path(__file__).with_name("corpus.txt")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 2
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 2048
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
INTERMEDIATE_SIZE = 688
WEIGHT_STD = 0.1
# Hidden states leave the final RMSNorm with unit scale, so logits have a std of about
# LM_HEAD_STD * sqrt(HIDDEN_SIZE) = 4: a top-1 probability near 0.4, so greedy decoding has clear
# winners and implementations that differ by rounding still agree on them.
LM_HEAD_STD = 0.25

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def default_cache_dir() -> Path:
    """`$STRATA_CACHE_DIR`, else `~/.cache/strata`."""
    return Path(os.environ.get("STRATA_CACHE_DIR") or Path.home() / ".cache" / "strata")


def ensure_default_model(cache_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Returns `<cache_dir>/models/strata-tiny-v1` (`cache_dir`: `default_cache_dir()` when None),
    building it first when absent (or when `force`): `ensure_model_at` that directory."""
    return ensure_model_at(Path(cache_dir or default_cache_dir()) / "models" / MODEL_NAME, force=force)


def ensure_model_at(target: str | Path, *, force: bool = False) -> Path:
    """Builds the model into the directory `target` itself unless it holds it already (or when
    `force`), and returns `target`. A directory that exists, is not empty and holds no `config.json`
    is refused (ValueError): it is something else, not to be overwritten.

    The directory appears atomically (built in a temporary sibling, then renamed), so a present
    directory is always complete and concurrent callers never see a partial checkpoint.
    """
    target = Path(target)
    is_model = (target / "config.json").is_file()
    if is_model and not force:
        return target
    if target.is_dir() and not is_model and any(target.iterdir()):
        raise ValueError(f"{target} exists and is not the built-in model ({MODEL_NAME}); give a new or empty "
                         "directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_default_model(staging)
        for path in (staging, *staging.iterdir()):  # mkdtemp and safetensors make them private
            path.chmod(0o755 if path.is_dir() else 0o644)
        if force and is_model:
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, retired / target.name)
            shutil.rmtree(retired)
        try:
            os.rename(staging, target)  # onto an empty directory too
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race with another builder
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_default_model(out_dir: Path, seed: int = SEED) -> None:
    """Writes every file of the checkpoint into the existing directory `out_dir`."""
    tokenizer = train_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    save_file(random_weights(seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name, content in _json_files().items():
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of VOCAB_SIZE ids (special tokens first) trained on the shipped corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} ids, expected {VOCAB_SIZE}; grow the corpus")
    return tokenizer


def random_weights(seed: int = SEED) -> dict[str, np.ndarray]:
    """Float32 weights under Hugging Face Llama names: normal(0, WEIGHT_STD) (LM_HEAD_STD for lm_head), norms 1."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = WEIGHT_STD) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    kv_size = NUM_KV_HEADS * HEAD_DIM
    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        prefix = f"model.layers.{i}."
        weights[prefix + "self_attn.q_proj.weight"] = normal(HIDDEN_SIZE, HIDDEN_SIZE)
        weights[prefix + "self_attn.k_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        weights[prefix + "self_attn.v_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        weights[prefix + "self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, HIDDEN_SIZE)
        weights[prefix + "mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[prefix + "mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[prefix + "mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        weights[prefix + "input_layernorm.weight"] = np.ones(HIDDEN_SIZE, dtype=np.float32)
        weights[prefix + "post_attention_layernorm.weight"] = np.ones(HIDDEN_SIZE, dtype=np.float32)
    weights["model.norm.weight"] = np.ones(HIDDEN_SIZE, dtype=np.float32)
    weights["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE, std=LM_HEAD_STD)
    return weights


def _json_files() -> dict[str, dict]:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE_SIZE,
        "hidden_act": "silu",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": WEIGHT_STD,
        "torch_dtype": "float32",
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": BOS_TOKEN_ID,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, SPECIAL_TOKENS.index(ENDOFTEXT)],
        "pad_token_id": BOS_TOKEN_ID,
    }
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": generation_config,
    }
