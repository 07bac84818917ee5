"""A checkpoint that has only SentencePiece's ``tokenizer.model`` (no tokenizer.json), made into the
`tokenizers` pipeline transformers builds from it.

Older Llama-family checkpoints (Vicuna, Yi, many Llama-2 fine-tunes) ship their tokenizer as a
SentencePiece BPE model. transformers' ``LlamaTokenizer`` converts it on load: the pieces become a BPE
vocabulary (each piece's id), its merges are every split of a piece into two pieces of the vocabulary,
ordered by the merged piece's id (``generate_merges``), with byte fallback; SentencePiece's control
pieces become special added tokens and its user-defined pieces plain added ones; the rest of the
pipeline is ``LlamaTokenizer``'s (`transformers_loading.rebuild_as_llama_tokenizer`) and BOS/EOS are
added as the config's ``add_bos_token`` (default true) and ``add_eos_token`` (default false) say.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, models, processors

from services.common.checkpoint_facts import read_pieces

_CONTROL, _USER_DEFINED = 3, 4  # SentencePiece's piece types (sentencepiece_model.proto)
_BPE = 2  # TrainerSpec.model_type


def tokenizer_from_sentencepiece(path: Path, tokenizer_config: Mapping[str, Any]) -> Tokenizer:
    """The BPE model and added tokens of ``path``; the caller applies LlamaTokenizer's pipeline, then
    ``add_bos_eos`` once the special tokens are registered."""
    proto = read_pieces(path)
    if proto.trainer_spec.model_type != _BPE:
        raise ValueError(f"{path} is a SentencePiece {_model_type_name(proto)} model; only BPE (Llama's) is "
                         f"supported without a tokenizer.json")
    vocab = {piece.piece: index for index, piece in enumerate(proto.pieces)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_merges(vocab), fuse_unk=True, byte_fallback=True))
    backend.add_tokens([AddedToken(piece.piece, normalized=False, special=piece.type == _CONTROL)
                        for piece in proto.pieces if piece.type in (_CONTROL, _USER_DEFINED)])
    return backend


def add_bos_eos(backend: Tokenizer, tokenizer_config: Mapping[str, Any], bos: str | None, eos: str | None) -> None:
    """What ``add_special_tokens`` adds, as transformers' ``update_post_processor`` sets it."""
    with_bos = bool(tokenizer_config.get("add_bos_token", True)) and bos is not None
    with_eos = bool(tokenizer_config.get("add_eos_token", False)) and eos is not None
    single = f"{f'{bos}:0 ' if with_bos else ''}$A:0{f' {eos}:0' if with_eos else ''}"
    pair = f"{single}{f' {bos}:1' if with_bos else ''} $B:1{f' {eos}:1' if with_eos else ''}"
    special = [(token, backend.token_to_id(token)) for token, used in ((bos, with_bos), (eos, with_eos)) if used]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary; a piece's splits by their parts' ids,
    the pieces by id (then the parts' lengths), as transformers' ``generate_merges`` orders them."""
    merges = []
    for piece, piece_id in vocab.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda split: (vocab[split[0]], vocab[split[1]]))
        merges += [(piece_id, left, right) for left, right in splits]
    merges.sort(key=lambda merge: (merge[0], len(merge[1]), len(merge[2])))
    return [(left, right) for _, left, right in merges]


def _model_type_name(proto) -> str:
    return {1: "Unigram", 2: "BPE", 3: "word", 4: "char"}.get(proto.trainer_spec.model_type, "unknown")
