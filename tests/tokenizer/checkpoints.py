"""Tokenizer checkpoints for parity tests, each unlike the built-in one in every way that matters.

`write_llama3_style_checkpoint`: a regex split before the byte-level step, a smaller vocabulary,
other special tokens, BOS added by a TemplateProcessing post-processor, a non-special added token,
an extra special token that only tokenizer_config.json names (so loading must add it), a chat
template stored in `chat_template.jinja` that uses bos_token, tojson, strftime_now and
raise_exception, eos ids from generation_config.json, and no config.json (max model len from
model_max_length).

`write_sentencepiece_style_checkpoint`: Llama-2 / TinyLlama style, with the tokenizer.json that they
(and Mistral-7B v0.1/v0.2) publish: a BPE on "▁"-words with byte fallback (`<unk>`, `<s>`, `</s>` at
ids 0, 1, 2, then the 256 `<0xNN>` tokens), the normalizer Prepend("▁") + Replace(" ", "▁") and no
pre-tokenizer, the decoder Replace + ByteFallback + Fuse + Strip(one leading space), BOS added by a
TemplateProcessing post-processor; a tokenizer_config.json of class LlamaTokenizerFast with
add_bos_token / add_eos_token, `legacy: false`, AddedToken-dict special tokens and the Llama-2
`[INST]` chat template; a config.json of model_type llama (so AutoTokenizer uses LlamaTokenizer).
The alphabet is limited so most non-ASCII text (CJK, emoji, rarer accented letters), newlines and
tabs are byte fallback.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from services.default_model.model import CORPUS_PATH

BEGIN, END, START_HEADER, END_HEADER, EOT = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
)
SPECIAL_TOKENS = [BEGIN, END, START_HEADER, END_HEADER, EOT]
ADDED_TOKEN = "<|reserved_0|>"  # added, not special: decode keeps it even when skipping special tokens
CONFIG_ONLY_SPECIAL_TOKEN = "<|python_tag|>"
VOCAB_SIZE = 1500
MODEL_MAX_LENGTH = 4096
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = """{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYear: ' + strftime_now('%Y') + '\\nTools:\\n' }}
{{- tools | tojson(indent=2) }}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{{- '<|start_header_id|>' + message['role'] }}
{%- if message['name'] is defined %}
{{- ' (' + message['name'] + ')' }}
{%- endif %}
{{- '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def write_llama3_style_checkpoint(directory: Path, *, with_chat_template: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)
    tokenizer.add_tokens([AddedToken(ADDED_TOKEN, special=False, normalized=False)])
    bos_id = tokenizer.token_to_id(BEGIN)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BEGIN} $A", pair=f"{BEGIN} $A {BEGIN} $B:1", special_tokens=[(BEGIN, bos_id)]
        ),
    ])
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN,
        "eos_token": EOT,
        "extra_special_tokens": [CONFIG_ONLY_SPECIAL_TOKEN],
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": True,  # as Llama 3 ships it; transformers ignores it for BPE
    })
    _write_json(directory / "generation_config.json", {
        "bos_token_id": bos_id, "eos_token_id": [tokenizer.token_to_id(END), tokenizer.token_to_id(EOT)]
    })
    if with_chat_template:
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return directory


UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SENTENCEPIECE_VOCAB_SIZE = 1000
SENTENCEPIECE_MODEL_VOCAB_SIZE = 3000  # the sentencepiece-trained one: merges enough for their order to matter
SENTENCEPIECE_ALPHABET_LIMIT = 90  # the most frequent characters; the rest of the corpus is byte fallback
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
LLAMA2_CHAT_TEMPLATE = (  # as meta-llama/Llama-2-7b-chat-hf ships it
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def write_sentencepiece_style_checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(_sentencepiece_style_bpe())
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)
    ])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in (UNK, BOS, EOS)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 1)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": _added_token_dict(BOS),
        "eos_token": _added_token_dict(EOS),
        "unk_token": _added_token_dict(UNK),
        "pad_token": None,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 10**30,  # transformers' "unset", as Llama-2 ships it: config.json decides
        "chat_template": LLAMA2_CHAT_TEMPLATE,
    })
    _write_json(directory / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    _write_json(directory / "config.json", {"model_type": "llama", "max_position_embeddings": MODEL_MAX_LENGTH})
    return directory


def _sentencepiece_style_bpe() -> models.BPE:
    """A BPE trained on "▁"-words, then laid out as Llama-2's: specials, the 256 byte tokens, the rest.

    Like Llama-2's, the vocabulary has no newline or tab: they are the byte tokens <0x0A> and <0x09>.
    """
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", "▁")
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    reserved = [UNK, BOS, EOS, *BYTE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=SENTENCEPIECE_VOCAB_SIZE, special_tokens=reserved,
        limit_alphabet=SENTENCEPIECE_ALPHABET_LIMIT, show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    trainer_tokenizer.train_from_iterator([line.replace("\t", " ") for line in lines], trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = dict(sorted(trained["vocab"].items(), key=lambda item: item[1]))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in trained["merges"]]
    return models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=True)


def _added_token_dict(content: str) -> dict:
    """A special token as tokenizer_config.json files of the transformers 4.3x era spell it."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False}


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2), encoding="utf-8")


def write_sentencepiece_model_checkpoint(directory: Path, legacy: bool = False, add_eos_token: bool = False) -> Path:
    """A checkpoint with only SentencePiece's tokenizer.model (no tokenizer.json), as Vicuna, Yi and many
    Llama-2 fine-tunes publish theirs: a BPE trained by sentencepiece as Llama-2's was (byte fallback,
    digits split, identity normalization, a dummy prefix), a user-defined piece and a control piece,
    a tokenizer_config.json of class LlamaTokenizer with a pad token the model has not (added by
    added_tokens_decoder), and the Llama-2 chat template."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    lines = [line for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(directory / "tokenizer"), model_type="bpe",
        vocab_size=SENTENCEPIECE_MODEL_VOCAB_SIZE, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, user_defined_symbols=["<custom>"], control_symbols=["<ctrl>"],
        character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (directory / "tokenizer.vocab").unlink()
    pad_id = SENTENCEPIECE_MODEL_VOCAB_SIZE
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": add_eos_token,
        "legacy": legacy,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "added_tokens_decoder": {
            "0": {**_added_token_dict(UNK), "special": True}, "1": {**_added_token_dict(BOS), "special": True},
            "2": {**_added_token_dict(EOS), "special": True},
            str(pad_id): {**_added_token_dict("<pad>"), "special": True}},
        "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA2_CHAT_TEMPLATE,
    })
    _write_json(directory / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    _write_json(directory / "config.json", {"model_type": "llama", "max_position_embeddings": MODEL_MAX_LENGTH})
    return directory
