"""A request as the engine tracks it, from arrival to finish."""

import enum
import time
from collections.abc import Sequence

from services.engine.sampling_params import SamplingParams


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
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1 until first scheduled
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled by the KV manager
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def extra_hash_keys(self) -> tuple[str, ...]:
        return (self.cache_salt,) if self.cache_salt else ()

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
