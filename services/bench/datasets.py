"""The workloads of `strata bench serve`: lists of requests with controlled prompt/output lengths.

A client cannot tokenize with the server's tokenizer in general, so prompt lengths are controlled
two ways (`--prompt-format`):
- `token-ids` (default on `/v1/completions`): the prompt is a list of token ids, which the
  OpenAI completions API accepts; ids are drawn uniformly from [0, --random-vocab-size), so the
  prompt is exactly the asked number of tokens and the server does no tokenization.
- `text` (always on `/v1/chat/completions`): random common English words, one word per intended
  token (about one token each in BPE vocabularies). Lengths are approximate (and a chat template
  adds its own tokens); the reported figures use the server's `usage.prompt_tokens`.

Workloads:
- `random`: lengths uniform in [L*(1-r), L*(1+r)] (`--random-range-ratio` r, as vLLM; outputs may
  take their own r, `--random-output-range-ratio`).
- `fixed`: one prompt repeated; with prefix caching every request after the first hits the cache.
- `shared-prefix`: `--prefix-num` system prompts of `--prefix-len` tokens; every request is one
  user's own `--suffix-len`-token question after one of them, in random order.
- `custom`: a JSON file of conversations in ShareGPT's shape
  `[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}]`, or JSONL
  with one `{"prompt": str, "output_tokens": int}` per line. The first human turn (after any system
  turn) is the prompt; `--custom-output-len`, else the reply's length (~4 characters a token), sets
  max_tokens. Entries are shuffled and reused when the file has fewer than needed.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "fixed", "shared-prefix", "custom")
CHARS_PER_TOKEN = 4  # the usual estimate for English text, used only where the server's count is absent

WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: `prompt` for /v1/completions, `messages` for /v1/chat/completions."""

    prompt_len: int  # intended prompt tokens: exact for token ids, an estimate for text
    output_len: int  # max_tokens
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class DatasetSpec:
    name: str = "random"
    chat: bool = False
    token_ids: bool = True
    vocab_size: int = 256
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    output_range_ratio: float | None = None  # None: range_ratio
    prefix_num: int = 4
    prefix_len: int = 512
    suffix_len: int = 64
    dataset_path: str | None = None
    custom_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"--dataset-name {self.name!r}: choose one of {', '.join(DATASETS)}")
        if self.chat and self.token_ids:
            raise ValueError("token-id prompts need /v1/completions; use --prompt-format text for chat")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio {self.range_ratio} must be in [0, 1)")
        if self.output_range_ratio is not None and not 0.0 <= self.output_range_ratio < 1.0:
            raise ValueError(f"--random-output-range-ratio {self.output_range_ratio} must be in [0, 1)")
        for flag, value in (("--random-input-len", self.input_len), ("--random-output-len", self.output_len),
                            ("--random-vocab-size", self.vocab_size), ("--prefix-num", self.prefix_num),
                            ("--suffix-len", self.suffix_len)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be at least 1")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len {self.prefix_len} must be >= 0")
        if self.name == "custom" and not self.dataset_path:
            raise ValueError("--dataset-name custom needs --dataset-path FILE")


def sample_requests(spec: DatasetSpec, num_requests: int, seed: int) -> list[BenchRequest]:
    """`num_requests` requests of the workload `spec.name`, the same for the same seed."""
    rng = np.random.default_rng(seed)
    build = {"random": _random, "fixed": _fixed, "shared-prefix": _shared_prefix, "custom": _custom}[spec.name]
    return build(spec, num_requests, rng)


def sample_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """n lengths uniform over the integers in [mean*(1-ratio), mean*(1+ratio)], at least 1."""
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _tokens(spec: DatasetSpec, rng: np.random.Generator, n: int) -> list[int] | str:
    if spec.token_ids:
        return [int(x) for x in rng.integers(0, spec.vocab_size, size=n)]
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


def _request(spec: DatasetSpec, parts: list[list[int] | str], prompt_len: int, output_len: int) -> BenchRequest:
    """Joins prompt parts (a system prompt, then the user's text) into the endpoint's shape."""
    if spec.chat:
        roles = ["system"] * (len(parts) - 1) + ["user"]
        messages = [{"role": role, "content": part} for role, part in zip(roles, parts) if part]
        return BenchRequest(prompt_len, output_len, messages=messages)
    if spec.token_ids:
        return BenchRequest(prompt_len, output_len, prompt=[t for part in parts for t in part])
    return BenchRequest(prompt_len, output_len, prompt=" ".join(p for p in parts if p))


def _random(spec: DatasetSpec, n: int, rng: np.random.Generator) -> list[BenchRequest]:
    input_lens = sample_lengths(rng, spec.input_len, spec.range_ratio, n)
    output_ratio = spec.range_ratio if spec.output_range_ratio is None else spec.output_range_ratio
    output_lens = sample_lengths(rng, spec.output_len, output_ratio, n)
    return [_request(spec, [_tokens(spec, rng, i)], i, o) for i, o in zip(input_lens, output_lens)]


def _fixed(spec: DatasetSpec, n: int, rng: np.random.Generator) -> list[BenchRequest]:
    one = _request(spec, [_tokens(spec, rng, spec.input_len)], spec.input_len, spec.output_len)
    return [one] * n


def _shared_prefix(spec: DatasetSpec, n: int, rng: np.random.Generator) -> list[BenchRequest]:
    prefixes = [_tokens(spec, rng, spec.prefix_len) for _ in range(spec.prefix_num)]
    prompt_len = spec.prefix_len + spec.suffix_len
    requests = [_request(spec, [prefixes[i % spec.prefix_num], _tokens(spec, rng, spec.suffix_len)],
                         prompt_len, spec.output_len) for i in range(n)]
    order = rng.permutation(n)
    return [requests[i] for i in order]


def _custom(spec: DatasetSpec, n: int, rng: np.random.Generator) -> list[BenchRequest]:
    entries = load_conversations(spec.dataset_path)
    order = rng.permutation(len(entries))
    requests = []
    for k in range(n):
        system, prompt, reply_tokens = entries[order[k % len(entries)]]
        output_len = spec.custom_output_len or reply_tokens or spec.output_len
        prompt_len = max(1, (len(system) + len(prompt)) // CHARS_PER_TOKEN)
        requests.append(_request(spec, [system, prompt] if system else [prompt], prompt_len, output_len))
    return requests


def load_conversations(path: str | Path) -> list[tuple[str, str, int | None]]:
    """(system prompt or "", first human turn, reply length in tokens or None) per usable entry."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        records: list[Any] = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    entries = [entry for entry in (_entry(r) for r in records) if entry is not None]
    if not entries:
        raise ValueError(f"{path}: no usable prompts (expected ShareGPT conversations or JSONL with 'prompt')")
    return entries


def _entry(record: dict[str, Any]) -> tuple[str, str, int | None] | None:
    if "prompt" in record:
        output = record.get("output_tokens")
        return "", str(record["prompt"]), int(output) if output else None
    system, prompt = "", None
    for turn in record.get("conversations", []):
        role, value = turn.get("from"), str(turn.get("value", ""))
        if prompt is None and role == "system":
            system = value
        elif prompt is None and role in ("human", "user"):
            prompt = value
        elif prompt is not None and role in ("gpt", "assistant"):
            return system, prompt, max(1, len(value) // CHARS_PER_TOKEN)
    return (system, prompt, None) if prompt else None
