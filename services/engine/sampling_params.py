"""Per-request sampling and stopping settings, validated at construction."""

import math
from dataclasses import dataclass, field
from functools import cached_property

from services.common.errors import InvalidRequestError
from services.engine.structured_output.constraint import Constraint

SAMPLING_EPS = 1e-5  # a temperature below this samples greedily (dividing by it would overflow the logits)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn and when a request stops. Defaults are OpenAI's."""

    temperature: float = 1.0  # 0 (or below SAMPLING_EPS, as vLLM) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) means off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top alternatives per sampled token; None means no logprobs
    prompt_logprobs: int | None = None  # top alternatives per prompt token after the first; None: none
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured_output: Constraint | None = None  # a JSON schema, regex, choice or grammar the output keeps to

    def __post_init__(self) -> None:
        """Every rule on these values lives here: the gateway sends what the client asked and maps a
        refusal's ``param`` (OpenAI's name for the field) back to the client's request."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value}.", param=name)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if len(set(self.stop_token_ids)) != len(self.stop_token_ids):  # a long repeated list costs every step
            object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        bad_bias = [v for v in self.logit_bias.values() if not (math.isfinite(v) and -100 <= v <= 100)]
        checks = [
            (self.temperature >= 0, "temperature", f"temperature must be non-negative, got {self.temperature}."),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}."),
            (self.top_k >= 0, "top_k", f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}."),
            (self.seed is None or 0 <= self.seed < 1 << 64, "seed", f"seed must be in [0, 2**64), got {self.seed}."),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}."),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."),
            (self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."),
            (not bad_bias, "logit_bias", f"logit_bias values must be in [-100, 100], got {bad_bias[:1]}."),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", f"logprobs must be >= 0, got {self.logprobs}."),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}."),
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}."),
            (self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)
