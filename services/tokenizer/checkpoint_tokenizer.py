"""One checkpoint's tokenizer, loaded from its Hugging Face files with `tokenizers` (no torch, no transformers).

Loading follows transformers' `AutoTokenizer` for tokenizers that ship a `tokenizer.json`, so ids
and text match it: `tokenizer.json` holds the model, the added tokens and the post-processor (which
decides what `add_special_tokens` adds, such as a Llama-style BOS); the special tokens named in
`tokenizer_config.json` are (re)registered as special, as transformers does on load; the parts of
the pipeline that transformers rebuilds for `LlamaTokenizer` are rebuilt the same way
(`transformers_loading.py`); the chat templates come from `chat_template.py`. Facts the engine
needs come from the checkpoint too, decided where the engine decides them
(`services.common.checkpoint_facts`): the eos ids and the longest sequence.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from services.common import checkpoint_facts
from services.common.errors import InvalidRequestError
from services.common.token_decoder import TokenDecoder
from services.tokenizer.chat_template import (
    DEFAULT_TEMPLATE_LIMITS,
    DEFAULT_TEMPLATE_NAME,
    TOOL_USE_TEMPLATE_NAME,
    cut_at_continuation_tag,
    load_chat_templates,
    render_chat,
    tag_final_message,
)
from services.tokenizer.sentencepiece_model import add_bos_eos, tokenizer_from_sentencepiece
from services.tokenizer.template_budget import TemplateLimits
from services.tokenizer.transformers_loading import loads_as_llama_tokenizer, rebuild_as_llama_tokenizer

# The named special tokens of transformers' tokenizers (`SPECIAL_TOKENS_ATTRIBUTES`).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# Above this many characters, encoding goes through `encode_batch_fast`, which releases the GIL (and
# skips the offsets): a 4 MB prompt took 3 s in `encode` with the tokenizer's event loop stalled all
# along; in `encode_batch_fast`, 1.4 s with the longest stall 35 ms. Same ids.
_LONG_TEXT = 16_384


# LlamaTokenizer's own special tokens, for a config that names none (its SentencePiece pieces)
LLAMA_TOKENIZER_DEFAULTS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@dataclass(frozen=True)
class CheckpointTokenizer:
    """Encode, chat-encode and decode for one checkpoint; read-only after loading, safe to share."""

    model: str
    backend: Tokenizer
    vocab_size: int
    special_tokens: Mapping[str, str]  # template variables such as bos_token -> "<s>"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    chat_templates: Mapping[str, str]
    decoder: TokenDecoder  # the backend with the ids incremental detokenization treats apart
    server_template: bool = False  # --chat-template replaced the default: it renders every chat, tools or not

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> "CheckpointTokenizer":
        """``chat_template`` (``--chat-template``'s source) replaces the checkpoint's default template."""
        model_dir = Path(model_dir)
        tokenizer_config = checkpoint_facts.tokenizer_config(model_dir)
        model_config = checkpoint_facts.read_json(model_dir / "config.json")
        from_sentencepiece = False
        if (model_dir / "tokenizer.json").is_file():
            tokenizer_json = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
            backend = Tokenizer.from_str(tokenizer_json)
            if loads_as_llama_tokenizer(tokenizer_json, tokenizer_config, model_config):
                rebuild_as_llama_tokenizer(backend, tokenizer_config)
        elif (model_dir / "tokenizer.model").is_file() and loads_as_llama_tokenizer("", tokenizer_config, model_config):
            from_sentencepiece = True
            tokenizer_config = {**LLAMA_TOKENIZER_DEFAULTS, **tokenizer_config}
            backend = tokenizer_from_sentencepiece(model_dir / "tokenizer.model", tokenizer_config)
            _add_config_tokens(backend, tokenizer_config)
            rebuild_as_llama_tokenizer(backend, tokenizer_config)
        else:
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (nor a SentencePiece tokenizer.model that "
                                    f"declares LlamaTokenizer); --model takes a Hugging Face checkpoint")
        special_tokens = _register_special_tokens(backend, tokenizer_config)
        if from_sentencepiece:
            add_bos_eos(backend, tokenizer_config, special_tokens.get("bos_token"), special_tokens.get("eos_token"))
        bos_token_id = _token_id(backend, special_tokens.get("bos_token"))
        eos_token_ids = checkpoint_facts.eos_token_ids(model_dir, backend.token_to_id)
        return cls(
            model=str(model_dir),
            backend=backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            special_tokens=special_tokens,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            max_model_len=checkpoint_facts.max_model_len(model_dir),
            chat_templates={**load_chat_templates(model_dir, tokenizer_config),
                            **({DEFAULT_TEMPLATE_NAME: chat_template} if chat_template else {})},
            decoder=TokenDecoder(
                backend,
                special_ids=frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special),
                byte_fallback_ids=_byte_fallback_ids(backend)),
            server_template=bool(chat_template),
        )

    @property
    def has_chat_template(self) -> bool:
        return DEFAULT_TEMPLATE_NAME in self.chat_templates

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _LONG_TEXT:  # `encode` holds the GIL throughout
            return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        chat_template: str = "",
        template_kwargs: Mapping[str, Any] | None = None,
        limits: TemplateLimits = DEFAULT_TEMPLATE_LIMITS,
        continue_final_message: bool = False,
    ) -> tuple[list[int], str]:
        """Renders the conversation and encodes it without special tokens, as `apply_chat_template` does.

        `chat_template` is a template source or the name of one of the checkpoint's templates;
        empty means the checkpoint's default. `continue_final_message` leaves the final message open
        (`chat_template.tag_final_message`). Returns the ids and the rendered text.
        """
        template = self._pick_template(chat_template, (template_kwargs or {}).get("tools") is not None)
        variables = {**self.special_tokens, **(template_kwargs or {})}
        if continue_final_message:
            messages = tag_final_message(messages)
        text = render_chat(template, messages, add_generation_prompt, variables, limits)
        if continue_final_message:
            text = cut_at_continuation_tag(text)
        return self.encode(text, add_special_tokens=False), text

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        self.check_ids(token_ids)
        return self.decoder.decode(token_ids, skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's string in the vocabulary (convert_ids_to_tokens); "" for an id below the model's
        vocabulary size that the tokenizer does not have."""
        self.check_ids(token_ids)
        return [self.backend.id_to_token(i) or "" for i in token_ids]

    def check_ids(self, token_ids: Sequence[int]) -> None:
        if token_ids and max(token_ids) >= self.vocab_size:
            bad = next(i for i in token_ids if i >= self.vocab_size)
            raise InvalidRequestError(f"token id {bad} is out of range: the vocabulary has {self.vocab_size} ids")

    def _pick_template(self, chat_template: str, with_tools: bool = False) -> str:
        """The request's template (a name or a source), else, as transformers' ``get_chat_template``, the
        checkpoint's ``tool_use`` template for a request with tools where it has one, else its default."""
        if chat_template:
            return self.chat_templates.get(chat_template, chat_template)
        if with_tools and not self.server_template and TOOL_USE_TEMPLATE_NAME in self.chat_templates:
            return self.chat_templates[TOOL_USE_TEMPLATE_NAME]
        if self.has_chat_template:
            return self.chat_templates[DEFAULT_TEMPLATE_NAME]
        if self.chat_templates:
            raise InvalidRequestError(
                f"{self.model} has several chat templates and none named 'default'; "
                f"pass one of {sorted(self.chat_templates)} as chat_template"
            )
        raise InvalidRequestError(f"{self.model} has no chat template: start the server with --chat-template "
                                  "(a template file, or the template itself), or pass one in chat_template")


def _add_config_tokens(backend: Tokenizer, tokenizer_config: Mapping[str, Any]) -> None:
    """tokenizer_config.json's ``added_tokens_decoder`` (by id, with their flags), as transformers adds
    them to a tokenizer it built itself; those the vocabulary has keep their ids."""
    entries = sorted((tokenizer_config.get("added_tokens_decoder") or {}).items(), key=lambda item: int(item[0]))
    for _, entry in entries:
        token = AddedToken(entry["content"], single_word=entry.get("single_word", False),
                           lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                           normalized=entry.get("normalized", False), special=entry.get("special", False))
        if entry.get("special", False):
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _register_special_tokens(backend: Tokenizer, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """Registers the config's special tokens as special in `backend`; returns the named ones by name.

    transformers adds every named token (`bos_token`, ..., and any other `*_token` string) and every
    extra special token to the backend as special on load, which decides what `skip_special_tokens`
    removes and makes them match as whole tokens in text.
    """
    named = {key: tokenizer_config[key] for key in NAMED_SPECIAL_TOKENS if tokenizer_config.get(key)}
    named |= {
        key: value
        for key, value in tokenizer_config.items()
        if key.endswith("_token") and key not in named and isinstance(value, str) and value
    }
    extra = tokenizer_config.get("extra_special_tokens") or tokenizer_config.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # model-specific names, e.g. {"image_token": "<image>"}
        named |= extra
        extra = []
    tokens = [_added_token(value) for value in [*named.values(), *extra]]
    if tokens:
        backend.add_special_tokens(tokens)
    return {key: _added_token(value).content for key, value in named.items()}


def _added_token(value: str | Mapping[str, Any]) -> AddedToken:
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    fields = {key: value[key] for key in ("lstrip", "rstrip", "single_word", "normalized") if key in value}
    return AddedToken(value["content"], special=True, **fields)


def _token_id(backend: Tokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _byte_fallback_ids(backend: Tokenizer) -> frozenset[int]:
    """The ids of the `<0xNN>` tokens if the decoder has ByteFallback (which decodes them as bytes)."""
    if backend.decoder is None or b'"ByteFallback"' not in backend.decoder.__getstate__():
        return frozenset()
    ids = (backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
    return frozenset(i for i in ids if i is not None)


