"""What the scheduler hands the model runner for one step, and what comes back."""

from dataclasses import dataclass, field

from services.engine.request import Request, RequestTimes


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute tokens
    ``request.all_token_ids[request.num_computed_tokens : request.num_computed_tokens + num_new_tokens]``
    at those positions, writing their K/V into ``block_ids`` (the request's whole block table).
    The step samples a token for this request iff ``samples``."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's batch: decodes first, then prefill chunks, under one token budget."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # preempted during this schedule() call
    num_decode_tokens: int = 0  # chunks of one token after a request's prompt: decodes (the rest is prefill)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens, and a preempted request's recomputed tokens."""
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def one_token_each(self) -> bool:
        """Every chunk has one new token: a decode step, as the model sees it (the native decode step's
        and the thread governor's rule)."""
        return self.num_batched_tokens == len(self.chunks)


@dataclass
class SampledLogprobs:
    """Logprob of a sampled token and the top alternatives at its position (most likely first)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, keyed by request id, for the chunks whose ``samples`` is true."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, SampledLogprobs] = field(default_factory=dict)
    # request id -> (j, entries): the logprobs of its prompt tokens j + 1, j + 2, ... that this step computed
    prompt_logprobs: dict[str, tuple[int, list[SampledLogprobs]]] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)  # requests whose own sampling failed


@dataclass
class RequestOutput:
    """What one step produced for one request, as streamed to its caller."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[SampledLogprobs]  # one per new token when the request asked for logprobs
    finish_reason: str | None  # None while running; else "stop", "length" or "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    times: RequestTimes  # the request's stage times as of this output
    stop_token_id: int | None = None
    # With the first token of a request that asked for them: one per prompt token after the first
    prompt_logprobs: list[SampledLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_first(self) -> bool:
        """Whether this output carries the request's first tokens (when its prompt counts as served)."""
        return bool(self.new_token_ids) and self.num_output_tokens == len(self.new_token_ids)
