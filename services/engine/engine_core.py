"""The synchronous engine: one `step()` schedules a batch, runs the model and returns outputs.

It is driven by one thread at a time (`AsyncEngine`'s engine loop, whose step runs on the event loop's
thread or on its step thread, never both at once; or offline code).
`validate()` is pure and safe from any thread, so callers learn about a bad request at once.
"""

import logging
import time
from collections.abc import Sequence

from services.common.errors import InvalidRequestError
from services.engine.config import EngineConfig
from services.engine.cpu_allocator import keep_freed_memory
from services.engine.generation_defaults import load_generation_defaults, log_defaults
from services.engine.kv_events import KvEventSink, NullKvEventSink
from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerStats
from services.engine.scheduler_output import ModelRunnerOutput, RequestOutput, ScheduledChunk, SchedulerOutput
from services.engine.threads import thread_governor

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, event_sink: KvEventSink | None = None) -> None:
        self.config = config
        # before the weights load: a bad --generation-config or file stops the start at once
        self.generation_defaults = load_generation_defaults(config.model, config.generation_config,
                                                            config.override_generation_config)
        log_defaults(self.generation_defaults, config.generation_config, bool(config.override_generation_config))
        if config.device == "cpu":
            keep_freed_memory()
        self.model_runner = ModelRunner(config)
        self.max_model_len = self.model_runner.max_model_len
        self.vocab_size = self.model_runner.vocab_size
        self.eos_token_ids = tuple(self.model_runner.eos_token_ids)
        self.structured_output = self.model_runner.structured_output
        self.scheduler = Scheduler(
            config,
            num_kv_blocks=self.model_runner.num_kv_blocks,
            max_model_len=self.max_model_len,
            event_sink=event_sink or NullKvEventSink(),
        )
        self.last_num_batched_tokens = 0
        step = self.model_runner.decode_step
        self.threads = (thread_governor(config.num_threads, bound=bool(step and step.thread_cores))
                        if self.model_runner.device.type == "cpu" else None)
        self._failures: dict[str, Exception] = {}

    @property
    def num_kv_blocks(self) -> int:
        return self.model_runner.num_kv_blocks

    def warmup(self) -> None:
        self.model_runner.warmup()

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError (naming the OpenAI parameter at fault) for a request that can never
        succeed; thread-safe. Together with SamplingParams' own checks, the only place these rules live."""
        num_prompt = len(prompt_token_ids)
        self.scheduler.check_prompt_fits(num_prompt)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is out of range: the vocabulary has "
                                      f"{self.vocab_size} ids", param="prompt")
        if num_prompt + params.max_tokens > self.max_model_len:  # vLLM's words
            raise InvalidRequestError(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {num_prompt} input tokens "
                f"({params.max_tokens} > {self.max_model_len} - {num_prompt}).", param="max_tokens")
        max_logprobs = min(self.config.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > max_logprobs:
                raise InvalidRequestError(f"{name} must be between 0 and {max_logprobs}, got {count}.", param=name)
        bad_bias = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias token id {bad_bias[0]} is out of vocabulary "
                                      f"(size {self.vocab_size}).", param="logit_bias")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad_stop}.",
                                      param="stop_token_ids")
        if params.structured_output is not None:
            bad_start = [t for t in params.structured_output.starts_after if not 0 <= t < self.vocab_size]
            if bad_start:
                raise InvalidRequestError(f"structured_output.starts_after must be in [0, {self.vocab_size}), "
                                          f"got {bad_start}.", param="structured_output")
            self.structured_output.check(params.structured_output)  # compiled (and cached) here

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
        fairness_key: str = "",
        arrival_time: float | None = None,
        validated: bool = False,
    ) -> Request:
        """Queues a request; ``arrival_time`` (`time.monotonic()`) is when the engine received it, by
        default now. ``validated``: the caller ran `validate` already (AsyncEngine, as the request
        arrived), so it is not checked again."""
        if not validated:
            self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                          cache_salt=cache_salt, arrival_time=arrival_time, fairness_key=fairness_key)
        if params.structured_output is not None:
            matcher = self.structured_output.matcher(params.structured_output)
            if params.structured_output.starts_after:
                request.dormant_grammar = matcher
            else:
                request.grammar = matcher
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
        """One step: schedule a batch, run the model, sample, advance the requests; returns what the
        requests produced. `schedule()` then `run()`, for a caller that places the run (AsyncEngine).

        A failure stays with the requests at fault. When the forward pass or the sampling raises,
        the step's chunks run again in halves, recursively (`_execute_isolating`), so a request
        that fails alone is failed while every other one gets its token. When the scheduler
        itself raises, no request can be blamed: the step's requests are failed. Failed requests
        are aborted (their blocks freed) and reported by ``take_failures()``; the engine goes on."""
        scheduler_output = self.schedule()
        return [] if scheduler_output is None else self.run(scheduler_output)

    def schedule(self) -> SchedulerOutput | None:
        """The next step's batch; None when there is nothing to run (or the scheduler failed)."""
        try:
            scheduler_output = self.scheduler.schedule()
        except Exception as error:  # the step's requests: the running ones and the one it was admitting
            self.last_num_batched_tokens = 0
            admitting = [self.scheduler.waiting[0]] if self.scheduler.waiting else []
            self._fail([r.request_id for r in self.scheduler.running + admitting], _step_error(error))
            return None
        self.last_num_batched_tokens = scheduler_output.num_batched_tokens
        return None if scheduler_output.is_empty else scheduler_output

    def run(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Runs the batch `schedule()` returned, before the next schedule(): the model, the sampling,
        the requests advanced."""
        started = time.perf_counter()
        if self.threads is not None:
            self.threads.before_step()
        runner_output = self._execute_isolating(scheduler_output.chunks)
        if self.threads is not None:
            self.threads.after_step(len(scheduler_output.chunks), scheduler_output.one_token_each,
                                    time.perf_counter() - started)
        step_request_ids = [chunk.request.request_id for chunk in scheduler_output.chunks]
        try:
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)  # skips the failed
        except Exception as error:
            self._fail(step_request_ids, _step_error(error))
            return []
        for output in outputs:
            if output.finished:
                self.model_runner.free_request(output.request_id)
        failed = runner_output.failed
        if len(step_request_ids) > 1 and len(failed) == len(step_request_ids):  # no one was spared: not theirs
            self._fail(step_request_ids, _step_error(next(iter(failed.values()))))
        for request_id, error in failed.items():
            self._fail([request_id], _request_error(error))
        return outputs

    def take_failures(self) -> dict[str, Exception]:
        """The requests failed since the last call (already aborted, their blocks freed), each with the
        error its caller should see: InvalidRequestError when the request was at fault, else an
        internal error that says whether it failed alone or with its whole step."""
        failures, self._failures = self._failures, {}
        return failures

    def _execute_isolating(self, chunks: list[ScheduledChunk]) -> ModelRunnerOutput:
        """Runs ``chunks``; if that raises, runs each half alone, recursively, down to single chunks:
        ``failed`` then names the requests that failed alone, the others' tokens are as if the
        culprits had never been in the step. A clean step costs nothing extra; one culprit among n
        chunks costs about 2·log2(n) more runs, a failure of every chunk 2n - 1.

        Running chunks again is safe: a run only writes K/V at positions the request has not
        computed yet, in blocks it alone holds (prefix-cache hits are full blocks before those
        positions), and the scheduler advances a request only from the run that returned its
        token; the sampler leaves seeded generators as they were when it raises."""
        try:
            return self.model_runner.execute(SchedulerOutput(chunks))
        except Exception as error:
            if len(chunks) == 1:
                logger.error("request %s failed in an engine step", chunks[0].request.request_id, exc_info=error)
                return ModelRunnerOutput(failed={chunks[0].request.request_id: error})
        logger.warning("an engine step of %d requests failed; running it again in halves to find the request at "
                       "fault", len(chunks))
        output = ModelRunnerOutput()
        half = len(chunks) // 2
        for part in (chunks[:half], chunks[half:]):
            part_output = self._execute_isolating(part)
            output.sampled_token_ids.update(part_output.sampled_token_ids)
            output.logprobs.update(part_output.logprobs)
            output.prompt_logprobs.update(part_output.prompt_logprobs)
            output.failed.update(part_output.failed)
        return output

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            if request_id not in self._failures:
                self.abort(request_id)
                self._failures[request_id] = error


def _step_error(error: Exception) -> RuntimeError:
    """What every request of a step sees when no one of them could be blamed."""
    return RuntimeError(f"an engine step failed ({type(error).__name__}: {error}); its requests were failed, "
                      f"the engine serves on")


def _request_error(error: Exception) -> Exception:
    """What the caller of the request at fault sees: its own InvalidRequestError, else an internal error."""
    if isinstance(error, InvalidRequestError):
        return error
    return RuntimeError(f"this request failed in the engine ({type(error).__name__}: {error}); the other requests "
                        f"of its batch went on")
