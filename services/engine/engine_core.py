"""The synchronous engine: one `step()` schedules a batch, runs the model and returns outputs.

It is driven by one thread at a time (the engine loop thread of `AsyncEngine`, or offline code).
`validate()` is pure and safe from any thread, so callers learn about a bad request at once.
"""

from collections.abc import Sequence

from services.common.errors import InvalidRequestError
from services.engine.config import EngineConfig
from services.engine.cpu_allocator import keep_freed_memory
from services.engine.kv_events import KvEventSink, NullKvEventSink
from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerStats
from services.engine.scheduler_output import RequestOutput


class EngineCore:
    def __init__(self, config: EngineConfig, event_sink: KvEventSink | None = None) -> None:
        self.config = config
        if config.device == "cpu":
            keep_freed_memory()
        self.model_runner = ModelRunner(config)
        self.max_model_len = self.model_runner.max_model_len
        self.vocab_size = self.model_runner.vocab_size
        self.eos_token_ids = tuple(self.model_runner.eos_token_ids)
        self.scheduler = Scheduler(
            config,
            num_kv_blocks=self.model_runner.num_kv_blocks,
            max_model_len=self.max_model_len,
            event_sink=event_sink or NullKvEventSink(),
        )
        self.last_num_batched_tokens = 0
        self._failures: dict[str, Exception] = {}

    @property
    def num_kv_blocks(self) -> int:
        return self.model_runner.num_kv_blocks

    def warmup(self) -> None:
        self.model_runner.warmup()

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError for a request that can never succeed; thread-safe."""
        num_prompt = len(prompt_token_ids)
        self.scheduler.check_prompt_fits(num_prompt)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is out of range: the vocabulary has {self.vocab_size} ids")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {num_prompt} input tokens "
                f"({params.max_tokens} > {self.max_model_len} - {num_prompt}).")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise InvalidRequestError(
                f"logprobs {params.logprobs} exceeds the maximum allowed {self.config.max_logprobs}")
        bad_bias = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias token id {bad_bias[0]} is out of range "
                                      f"(vocabulary of {self.vocab_size})")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids: token id {bad_stop[0]} is out of range "
                                      f"(vocabulary of {self.vocab_size})")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
    ) -> Request:
        self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                          cache_salt=cache_salt)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Aborts a waiting or running request and frees its blocks; unknown ids are ignored."""
        outputs = self.scheduler.abort_request(request_id)
        self.model_runner.free_request(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """One step. A request that fails alone (in its sampling) is aborted and reported by
        ``take_failures()`` while the others go on; a failure of the step itself (the forward pass)
        aborts that step's requests and raises StepFailed naming them; other requests are untouched."""
        scheduler_output = self.scheduler.schedule()
        self.last_num_batched_tokens = scheduler_output.num_batched_tokens
        if scheduler_output.is_empty:
            return []
        try:
            runner_output = self.model_runner.execute(scheduler_output)
        except Exception as error:
            request_ids = sorted({chunk.request.request_id for chunk in scheduler_output.chunks})
            for request_id in request_ids:
                self.abort(request_id)
            raise StepFailed(request_ids, error) from error
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        for output in outputs:
            if output.finished:
                self.model_runner.free_request(output.request_id)
        for request_id, error in runner_output.failed.items():
            self.abort(request_id)
            self._failures[request_id] = error
        return outputs

    def take_failures(self) -> dict[str, Exception]:
        """The requests that failed alone in the steps since the last call (aborted, blocks freed)."""
        failures, self._failures = self._failures, {}
        return failures


class StepFailed(RuntimeError):
    """A step failed as a whole; its requests (``request_ids``) were aborted, the engine goes on."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(f"an engine step failed ({type(error).__name__}: {error}); its {len(request_ids)} "
                         f"request(s) were aborted")
        self.request_ids = request_ids
        self.error = error
