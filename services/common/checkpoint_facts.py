"""Facts about a Hugging Face checkpoint that more than one service needs, each decided here once:
the ids that end generation and the longest sequence. The engine (which stops requests and sizes
its context) and the tokenizer service (which tells the gateway what an EOS is) read them from here,
so they cannot disagree.

- **EOS ids**, as vLLM takes them: the tokenizer's `eos_token` (tokenizer_config.json, or a legacy
  special_tokens_map.json) first, then generation_config.json's `eos_token_id` (one id or a list);
  config.json's `eos_token_id` only when neither names one. The first is the checkpoint's own: a request
  that ends on another (Llama 3.1 Instruct's `<|eom_id|>`, Qwen2.5's `<|endoftext|>`) reports it as its
  stop_reason, as vLLM makes generation_config.json's extra EOS ids stop tokens.
- **Longest sequence**: config.json's `max_position_embeddings` (or its `text_config`'s), times the
  rope scaling's `factor` as vLLM derives it (every scaling but `llama3` and `longrope`, whose
  checkpoints state their extended length; `yarn` scales its `original_max_position_embeddings`):
  a Llama-2 fine-tune with `max_position_embeddings` 4096 and linear scaling of 4 serves 16,384
  tokens. Without it, the tokenizer's `model_max_length` when it is set.
"""

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# transformers uses a huge `model_max_length` to mean "not set".
_UNSET_MODEL_MAX_LENGTH = 10**12
# Rope scalings whose checkpoints give their extended length as max_position_embeddings ("su" is longrope's
# old name); vLLM's list.
_SCALINGS_OF_STATED_LENGTH = ("llama3", "longrope", "su")


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file, or {} when it has none; ValueError naming the file when it holds no JSON
    object."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json, with a legacy special_tokens_map.json merged over it as transformers does."""
    config = read_json(model_dir / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:
        config |= read_json(model_dir / "special_tokens_map.json")
    return config


def token_content(value: str | Mapping[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json names it: a string, or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value or None


def eos_token_ids(model_dir: str | Path, token_to_id: Callable[[str], int | None] | None = None) -> tuple[int, ...]:
    """The ids that end generation (see the module's docstring). ``token_to_id`` looks the tokenizer's eos
    token up (the tokenizer service passes its loaded tokenizer's); by default tokenizer.json is read."""
    model_dir = Path(model_dir)
    eos_token = token_content(tokenizer_config(model_dir).get("eos_token"))
    ids: list[int | None] = []
    if eos_token is not None:
        ids.append((token_to_id or _tokenizer_json_lookup(model_dir))(eos_token))
    configured = read_json(model_dir / "generation_config.json").get("eos_token_id")
    ids += configured if isinstance(configured, list) else [configured]
    if not any(i is not None for i in ids):
        fallback = read_json(model_dir / "config.json").get("eos_token_id")
        ids = fallback if isinstance(fallback, list) else [fallback]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def max_model_len(model_dir: str | Path) -> int:
    """The longest sequence the checkpoint supports (see the module's docstring); ValueError if it says none."""
    model_dir = Path(model_dir)
    config = read_json(model_dir / "config.json")
    for section in (config, config.get("text_config") or {}):
        if section.get("max_position_embeddings"):
            return _rope_scaled(int(section["max_position_embeddings"]), section)
    model_max_length = tokenizer_config(model_dir).get("model_max_length")
    if model_max_length and model_max_length < _UNSET_MODEL_MAX_LENGTH:
        return int(model_max_length)
    raise ValueError(f"{model_dir}: no max_position_embeddings in config.json and no model_max_length in "
                     f"tokenizer_config.json")


def _rope_scaled(max_positions: int, config: Mapping[str, Any]) -> int:
    """``max_positions`` as the config's rope scaling extends it (see the module's docstring); both the
    transformers-5 ``rope_parameters`` and the older ``rope_scaling`` (``type`` or ``rope_type``)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type in _SCALINGS_OF_STATED_LENGTH or not rope.get("factor"):
        return max_positions
    if rope_type == "yarn":
        max_positions = int(rope.get("original_max_position_embeddings") or max_positions)
    return int(max_positions * float(rope["factor"]))


def _tokenizer_json_lookup(model_dir: Path) -> Callable[[str], int | None]:
    """token -> id from tokenizer.json's added tokens and vocabulary, without loading a tokenizer (from
    SentencePiece's tokenizer.model where that is all the checkpoint has)."""
    if not (model_dir / "tokenizer.json").is_file() and (model_dir / "tokenizer.model").is_file():
        pieces = {piece.piece: i for i, piece in enumerate(read_pieces(model_dir / "tokenizer.model").pieces)}
        return pieces.get
    tokenizer = read_json(model_dir / "tokenizer.json")
    ids = {token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])}
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    return lambda token: ids.get(token, vocab.get(token))


def read_pieces(path: Path):
    """A SentencePiece ``tokenizer.model``'s ``ModelProto`` (its pieces, trainer and normalizer specs)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return proto
