"""What transformers changes in a tokenizer.json's pipeline when it loads one, done the same way.

transformers 5 does not always run tokenizer.json as written. A tokenizer class with its own
`__init__` keeps only the vocabulary, merges, added tokens and post-processor of the file and builds
the rest itself: `LlamaTokenizer` (also named `LlamaTokenizerFast`, the class that Llama-2, TinyLlama
and many SentencePiece-converted checkpoints declare) replaces the file's normalizer
Prepend("▁") + Replace(" ", "▁") with a Metaspace pre-tokenizer whose prefix depends on `legacy` and
`add_prefix_space`. So " hi" is "▁hi", not "▁▁hi", and text after a special token such as `<s>[INST]`
gets no "▁" unless `legacy` is true. `AutoTokenizer` picks that class only when the checkpoint
declares it, its tokenizer.json is not byte-level, and config.json's `model_type` has no generic
tokenizer of its own (Mistral-7B declares LlamaTokenizer, but `mistral` loads tokenizer.json as is).
What `add_special_tokens` adds stays the file's post-processor either way: with a tokenizer.json,
transformers drops the config's `add_bos_token` and `add_eos_token`.
"""

from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer, decoders, pre_tokenizers

LLAMA_CLASS = "LlamaTokenizer"
METASPACE = "▁"
# Causal-LM model types whose AutoTokenizer class is the generic TokenizersBackend (transformers'
# TOKENIZER_MAPPING_NAMES and MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): a declared class is ignored.
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({
    "arctic", "ernie4_5", "ernie4_5_moe", "flex_olmo", "glm", "glm4", "glm4_moe", "gpt_bigcode", "granite",
    "granitemoe", "granitemoehybrid", "granitemoeshared", "internlm2", "internlm3", "jamba", "minicpm3",
    "ministral", "ministral3", "mistral", "mistral3", "mixtral", "nemotron", "olmo2", "olmo3", "persimmon",
    "phi3", "phimoe", "stablelm",
})


def loads_as_llama_tokenizer(
    tokenizer_json: str, tokenizer_config: Mapping[str, Any], model_config: Mapping[str, Any]
) -> bool:
    """Whether `AutoTokenizer` loads the checkpoint with `LlamaTokenizer` (else with tokenizer.json as is)."""
    declared = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class") or ""
    return (
        declared.removesuffix("Fast") == LLAMA_CLASS
        and model_config.get("model_type") not in GENERIC_TOKENIZER_MODEL_TYPES
        and '"ByteLevel"' not in tokenizer_json  # a Llama-3-style tokenizer that declares the old class
    )


def rebuild_as_llama_tokenizer(backend: Tokenizer, tokenizer_config: Mapping[str, Any]) -> None:
    """transformers' `LlamaTokenizer.__init__`: `legacy` defaults to false, `add_prefix_space` to true."""
    add_prefix_space = tokenizer_config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else add_prefix_space
    if not add_prefix_space:
        prepend_scheme = "never"
    else:  # "first": the text's start only, not each stretch after a special token
        prepend_scheme = "always" if tokenizer_config.get("legacy", False) else "first"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme=prepend_scheme, split=False)
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:  # the space that the prefix stands for is not part of the text
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
