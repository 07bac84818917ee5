"""Offline, in-process use of the engine: submit many prompts, run steps until all finish."""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import SampledLogprobs
from services.engine.threads import set_num_threads


@dataclass
class Completion:
    """The whole output of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[SampledLogprobs] | None = None  # when asked for: one per prompt token after the first


class LLM:
    def __init__(self, config: EngineConfig) -> None:
        """Sets torch's thread count (`threads.set_num_threads`): run `generate` on this thread."""
        set_num_threads(config.num_threads)
        self.core = EngineCore(config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Completion]:
        """Runs every prompt to completion, all in one continuous batch; results in prompt order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        completions: dict[str, Completion] = {}
        for prompt, prompt_params in zip(prompts, per_prompt):
            request_id = f"offline-{next(self._ids)}"
            self.core.add_request(request_id, prompt, prompt_params)
            completions[request_id] = Completion(request_id, list(prompt))
        while self.core.has_unfinished_requests():
            outputs = self.core.step()
            failures = self.core.take_failures()
            if failures:  # a request that failed alone: offline, the caller hears of it
                for request_id in completions:
                    self.core.abort(request_id)
                raise next(iter(failures.values()))
            for output in outputs:
                completion = completions[output.request_id]
                completion.token_ids += output.new_token_ids
                completion.logprobs += output.logprobs
                if output.prompt_logprobs is not None:
                    completion.prompt_logprobs = output.prompt_logprobs
                completion.num_cached_tokens = output.num_cached_tokens
                completion.finish_reason = output.finish_reason
        return list(completions.values())
