"""A second tokenizer checkpoint for parity tests, unlike the built-in one in every way that matters.

Llama-3 style: a regex split before the byte-level step, a smaller vocabulary, other special tokens,
BOS added by a TemplateProcessing post-processor, a non-special added token, an extra special token
that only tokenizer_config.json names (so loading must add it), a chat template stored in
`chat_template.jinja` that uses bos_token, tojson, strftime_now and raise_exception, eos ids from
generation_config.json, and no config.json (max model len from model_max_length).
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.common.default_model import CORPUS_PATH

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


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2), encoding="utf-8")
