"""A request as the engine tracks it, from arrival to finish."""

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.sampling_params import SamplingParams
from services.engine.seen_tokens import SeenTokens


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its KV blocks were freed, it will be recomputed
    FINISHED_STOPPED = "stop"  # eos or a stop token id
    FINISHED_LENGTH = "length"  # max_tokens or the model's context length
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True)
class RequestTimes:
    """When a request reached each stage in the engine, in `time.monotonic()` seconds; None: not yet.

    The scheduler sets them: ``first_scheduled`` once (a preempted request keeps it), the token times
    at the end of each step that sampled a token for the request, ``finished`` when it stops.
    A `RequestOutput` carries a copy, as of that output."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    previous_token: float | None = None  # when the token before the latest one was sampled
    last_token: float | None = None
    finished: float | None = None

    def copy(self) -> "RequestTimes":
        # every output of every step makes one: the constructor, not dataclasses.replace, which
        # looks the fields up again each time (~4x slower)
        return RequestTimes(self.arrival, self.first_scheduled, self.first_token, self.previous_token,
                            self.last_token, self.finished)

    @property
    def queue_s(self) -> float | None:
        """Arrival to first scheduled (a preempted request's later waits are not queue time)."""
        return _between(self.arrival, self.first_scheduled)

    @property
    def prefill_s(self) -> float | None:
        """First scheduled to first token."""
        return _between(self.first_scheduled, self.first_token)

    @property
    def decode_s(self) -> float | None:
        """First token to finished."""
        return _between(self.first_token, self.finished)

    @property
    def inference_s(self) -> float | None:
        """First scheduled to finished."""
        return _between(self.first_scheduled, self.finished)

    @property
    def inter_token_s(self) -> float | None:
        """Previous token to the latest one; None up to the first token."""
        return _between(self.previous_token, self.last_token)


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


class Request:
    """Token state of one request. The scheduler moves ``num_computed_tokens`` forward (tokens whose
    KV is in the cache); sampled tokens are appended with ``append_output``.

    Invariant: ``num_computed_tokens <= num_tokens``; the request needs a new token sampled when a
    step computes up to ``num_tokens`` (its last known token).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        cache_salt: str = "",
        arrival_time: float | None = None,
        fairness_key: str = "",
    ) -> None:
        self.request_id = request_id
        # Requests sharing a key (one API call's fan-out, one tenant) share the batch fairly with
        # other keys (see Scheduler); empty: the request id, a key of its own.
        self.fairness_key = fairness_key or request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        # The first is the checkpoint's own (its tokenizer's eos_token, `checkpoint_facts.eos_token_ids`); the
        # others (generation_config.json's) end the request as stop tokens do, their id reported, as vLLM.
        self.primary_eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.cache_salt = cache_salt
        self.times = RequestTimes(time.monotonic() if arrival_time is None else arrival_time)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1 until first scheduled
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled by the KV manager
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        self.num_preemptions = 0
        # Structured output: its llguidance matcher, advanced by the scheduler with each token it
        # accepts (a preempted request keeps its tokens, so the matcher stays where it was); None: free.
        # A constraint that starts after some tokens (a reasoning model's end of thinking) waits in
        # ``dormant_grammar`` until the output ends with them.
        self.grammar = None
        self.dormant_grammar = None
        # Prompt logprobs being gathered: entry j for prompt token j + 1, filled as the steps compute
        # positions j; None when not asked for, or once delivered with the first token. While gathering,
        # the request takes nothing from the prefix cache (a cached position has no logits).
        self.prompt_logprobs: list | None = (
            [None] * (len(self.prompt_token_ids) - 1) if sampling_params.prompt_logprobs is not None else None)
        # The distinct tokens seen so far, for the penalties (`seen_tokens.py`): made at the first step that
        # samples the request with one, then kept up to date with each output token.
        self.seen_tokens: SeenTokens | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.seen_tokens is not None:
            self.seen_tokens.add_output(token_id)

    def seen(self) -> SeenTokens:
        """The distinct tokens of the prompt and output so far (made at the first call)."""
        if self.seen_tokens is None:
            self.seen_tokens = SeenTokens(self.prompt_token_ids, self.output_token_ids)
        return self.seen_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
