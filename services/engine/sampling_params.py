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
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured_output: Constraint | None = None  # a JSON schema, regex, choice or grammar the output keeps to

    def __post_init__(self) -> None:
        floats = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "repetition_penalty": self.repetition_penalty}
        for name, value in floats.items():
            if not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value}")
        bad_bias = [v for v in self.logit_bias.values() if not math.isfinite(v)]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias values must be finite numbers, got {bad_bias[0]}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if len(set(self.stop_token_ids)) != len(self.stop_token_ids):  # a long repeated list costs every step
            object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        if any(abs(v) > 100 for v in self.logit_bias.values()):  # OpenAI's range: clamp, as vLLM does
            object.__setattr__(self, "logit_bias", {t: max(-100.0, min(100.0, v)) for t, v in self.logit_bias.items()})
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}"),
            (self.seed is None or 0 <= self.seed < 1 << 64, f"seed must be in [0, 2**64), got {self.seed}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)
