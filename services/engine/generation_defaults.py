"""The checkpoint's recommended sampling: generation_config.json's values for what a request leaves
unset, as vLLM applies them (its `--generation-config auto`, the default).

Model creators publish how their model should be sampled in generation_config.json (Llama 3.1
Instruct: temperature 0.6 and top_p 0.9; Qwen2.5 Instruct: temperature 0.7, top_p 0.8, top_k 20 and
repetition_penalty 1.05). vLLM takes five of its keys, temperature, top_p, top_k, min_p and
repetition_penalty, as the defaults of every request that does not set them, and max_new_tokens as
the default max_tokens; so does Strata. A value the client sends always wins, and where the file
says nothing OpenAI's neutral defaults hold (`SamplingParams`). The engine applies the sampling keys
itself; its Info tells the gateway the default max_tokens and temperature (with a greedy default,
n > 1 is refused, as vLLM refuses it). `do_sample` is ignored, as vLLM
ignores it: a file that names a temperature is read as recommending it.

Sources (`--generation-config`): `auto` reads the checkpoint's own file, `vllm` (vLLM's spelling)
applies none, and a folder reads that folder's generation_config.json.
`--override-generation-config '{"temperature": 0.5}'` sets keys over the file's, as vLLM's flag.
A value no request could carry (top_p 0, a negative temperature) stops the engine at start, naming
the file and the key, rather than failing every request that leaves it unset.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.checkpoint_facts import read_json
from services.common.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_TOKENS_KEY = "max_new_tokens"
SOURCES = ("auto", "vllm")  # or a folder


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a field unset gets instead of OpenAI's neutral default."""
    sampling: dict[str, float | int] = field(default_factory=dict)  # SamplingParams fields
    max_tokens: int | None = None  # None: the rest of the context

    def describe(self) -> str:
        named = dict(self.sampling) | ({"max_tokens": self.max_tokens} if self.max_tokens is not None else {})
        return ", ".join(f"{name}={value}" for name, value in named.items())


def load_generation_defaults(model_dir: str | Path, source: str = "auto",
                             overrides: str | dict[str, Any] | None = None) -> GenerationDefaults:
    """The defaults of ``source`` (see the module's docstring) with ``overrides`` (a JSON object or its
    text) set over them; ValueError for a source, a key or a value that cannot be used."""
    path = _config_path(model_dir, source)
    values = read_json(path) if path is not None else {}
    overriding = _parse_overrides(overrides)
    unknown = sorted(set(overriding) - set(SAMPLING_KEYS) - {MAX_TOKENS_KEY})
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} cannot be set; the keys that can: "
                         f"{', '.join(SAMPLING_KEYS + (MAX_TOKENS_KEY,))}")
    values |= overriding

    def refuse(name: str, problem: str) -> ValueError:
        where = "--override-generation-config" if name in overriding else str(path)
        return ValueError(f"{where}: {problem} Serve with --generation-config vllm to ignore the file, or set "
                          f"{name} with --override-generation-config.")

    sampling = {name: values[name] for name in SAMPLING_KEYS if values.get(name) is not None}
    for name, value in sampling.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(name, f"{name} must be a number, got {value!r}.")
        if name == "top_k":
            if value != int(value):
                raise refuse(name, f"top_k must be an integer, got {value!r}.")
            sampling[name] = int(value)
    try:
        SamplingParams(**sampling)  # every rule a request's own values meet
    except InvalidRequestError as error:
        raise refuse(error.param or "it", str(error)) from None

    max_tokens = values.get(MAX_TOKENS_KEY)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise refuse(MAX_TOKENS_KEY, f"{MAX_TOKENS_KEY} must be an integer of at least 1, got {max_tokens!r}.")
    return GenerationDefaults(sampling, max_tokens)


def _config_path(model_dir: str | Path, source: str) -> Path | None:
    if source == "vllm":
        return None
    folder = Path(model_dir) if source == "auto" else Path(source)
    if source != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {source}: no generation_config.json in that folder (or one of "
                         f"{', '.join(SOURCES)})")
    return folder / "generation_config.json"


def _parse_overrides(overrides: str | dict[str, Any] | None) -> dict[str, Any]:
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    try:
        parsed = json.loads(overrides)
    except json.JSONDecodeError as error:
        raise ValueError(f"--override-generation-config must be a JSON object: {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"--override-generation-config must be a JSON object, got {overrides!r}")
    return parsed


def log_defaults(defaults: GenerationDefaults, source: str, overridden: bool = False) -> None:
    """One line at start, as vLLM warns, so that nobody wonders where a request's temperature came from."""
    if defaults.sampling or defaults.max_tokens is not None:
        origin = {"auto": "the checkpoint's generation_config.json", "vllm": "none"}.get(
            source, f"{source}/generation_config.json")
        if overridden:
            origin = "--override-generation-config" + ("" if source == "vllm" else f" over {origin}")
        hint = "" if source == "vllm" else "; serve with --generation-config vllm for OpenAI's neutral defaults"
        log.warning("requests that leave them unset get %s (from %s)%s", defaults.describe(), origin, hint)
    elif source != "vllm":
        log.info("generation_config.json recommends no sampling defaults: OpenAI's neutral ones apply")
