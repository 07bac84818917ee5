"""One request's choices: n Generate streams per prompt, each detokenized here with the tokenizer's
decoder (`Upstream.decoder`) and cut at stop strings, merged into one stream of ``Step``s.

Contract: every choice yields steps until exactly one step with a ``finish_reason``. Cancelling
(``FanOut.cancel()``, a client disconnect, or a stop string) cancels that choice's Generate call,
which aborts the request in the engine and frees its KV blocks.
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from services.common.inbox import Inbox
from services.common.pb import engine_pb2
from services.gateway import errors, genai_span
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.upstream import Upstream
from services.gateway.validation import GenerationParams

# Prompt ids handed to the detokenizer as context, so the first token's text (leading spaces,
# SentencePiece markers) comes out as it does inside the whole sequence.
_DETOKENIZE_PREFIX_IDS = 8

_FINISH_REASONS = {
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass
class ChoiceSpec:
    """One choice to generate: its index in the response and its engine request."""
    index: int
    prompt_index: int
    prompt_ids: list[int]
    request: engine_pb2.GenerateRequest


@dataclass
class Step:
    """New output of one choice. ``text`` is final (stop strings already applied)."""
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[engine_pb2.SampledLogprobs] = field(default_factory=list)
    prompt_logprobs: list[engine_pb2.SampledLogprobs] = field(default_factory=list)  # with the first token
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def plan_choices(request_id: str, prompts: list[list[int]], max_tokens: list[int],
                 params: GenerationParams) -> list[ChoiceSpec]:
    """n choices per prompt; choice index = prompt_index * n + i, as vLLM numbers them."""
    specs = []
    for prompt_index, (prompt_ids, prompt_max_tokens) in enumerate(zip(prompts, max_tokens)):
        for i in range(params.n):
            index = prompt_index * params.n + i
            request = engine_pb2.GenerateRequest(
                request_id=f"{request_id}-{index}", prompt_token_ids=prompt_ids,
                sampling=params.sampling_proto(i), stop=params.stop_proto(prompt_max_tokens),
                cache_salt=params.cache_salt, fairness_key=request_id)  # one call's fan-out shares its seats
            if params.constraint is not None:
                request.structured_output.CopyFrom(params.constraint.proto)
            specs.append(ChoiceSpec(index, prompt_index, prompt_ids, request))
    return specs


def _named(error: errors.OpenAIError, params: GenerationParams) -> errors.OpenAIError:
    """A refusal (400) names the client's field, not the engine's."""
    if error.status == 400:
        error.param = params.request_param(error.param)
    return error


async def run_choice(upstream: Upstream, spec: ChoiceSpec, params: GenerationParams,
                     eos_token_ids: frozenset[int], generate=None) -> AsyncIterator[Step]:
    """Each engine output's ids become text as soon as it is read. ``generate``: the choice's Generate
    call, where the caller made it (to cancel it without this generator), else made here."""
    if generate is None:
        generate = upstream.generate(spec.request)
    detokenizer = upstream.decoder.detokenizer(params.skip_special_tokens, spec.prompt_ids[-_DETOKENIZE_PREFIX_IDS:])
    outputs = aiter(generate)
    matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
    num_tokens = 0
    try:
        while True:
            try:
                output = await anext(outputs, None)
            except grpc.RpcError as error:
                raise _named(errors.from_grpc(error, "engine"), params) from None
            except errors.OpenAIError as error:
                raise _named(error, params) from None
            if output is None:
                raise errors.OpenAIError("engine ended the stream without a finish reason", 502)
            num_tokens += len(output.token_ids)
            finish = _FINISH_REASONS.get(output.finish_reason)
            text = detokenizer.step(_rendered_ids(output, finish, params, eos_token_ids))
            if finish is not None:
                text += detokenizer.flush()
            match = matcher.feed(text, can_stop=num_tokens >= params.min_tokens)
            step = Step(spec.index, match.text, list(output.token_ids),
                        list(output.logprobs) if output.logprobs else [],  # most requests ask for none
                        prompt_logprobs=list(output.prompt_logprobs) if output.prompt_logprobs else [],
                        prompt_tokens=output.usage.prompt_tokens or len(spec.prompt_ids),
                        completion_tokens=output.usage.completion_tokens or num_tokens,
                        cached_tokens=output.usage.cached_prompt_tokens)
            if match.stop is not None:
                step.finish_reason, step.stop_reason = "stop", match.stop
                trace.get_current_span().add_event(genai_span.STAGE_STOP_STRING, {
                    "gen_ai.choice.index": spec.index, "strata.stop_string": match.stop})
                yield step
                return
            if finish is not None:
                step.text += matcher.flush()
                step.finish_reason = finish
                if output.HasField("stop_token_id") and output.stop_token_id not in eos_token_ids:
                    step.stop_reason = output.stop_token_id
                yield step
                return
            yield step
    finally:
        generate.cancel()


def _rendered_ids(output, finish: str | None, params: GenerationParams, eos_token_ids: frozenset[int]):
    """The output's ids whose text the answer shows: not the EOS or stop token that ended it (whose text
    a client sees only with include_stop_str_in_output, or as nothing when special tokens are skipped),
    as vLLM renders it."""
    ids = output.token_ids
    if finish == "stop" and ids and not params.include_stop_str_in_output \
            and (output.HasField("stop_token_id") or ids[-1] in eos_token_ids):
        return ids[:-1]
    return ids


class FanOut:
    """Runs every choice concurrently and merges their steps in arrival order. ``cancel()`` is
    synchronous so it also works from a cancelled task's cleanup.

    Several choices each run in a task of their own, which reads its next output while the consumer
    handles a step. A single choice (``n`` = 1, most requests) runs in the consumer's own task instead:
    one task wake-up and one queue fewer per token."""

    _DONE = object()

    def __init__(self, upstream: Upstream, specs: list[ChoiceSpec], params: GenerationParams,
                 eos_token_ids: frozenset[int]) -> None:
        self._queue: Inbox = Inbox()
        self._single = self._single_call = None
        self._tasks = []
        if len(specs) == 1:
            self._single_call = upstream.generate(specs[0].request)
            self._single = run_choice(upstream, specs[0], params, eos_token_ids, self._single_call)
        else:
            self._tasks = [asyncio.create_task(self._pump(run_choice(upstream, spec, params, eos_token_ids)))
                           for spec in specs]
        self._remaining = len(specs)
        self._cancelled = False
        self.finished = False  # every choice ran to its finish step

    async def _pump(self, steps: AsyncIterator[Step]) -> None:
        try:
            async for step in steps:
                self._queue.put(step)
        except Exception as error:  # handed to the consumer, which raises it
            self._queue.put(error)
        finally:
            self._queue.put(self._DONE)

    def __aiter__(self) -> "FanOut":
        return self

    async def __anext__(self) -> Step:
        while self._remaining:
            if self._single is not None:
                try:
                    return await anext(self._single)
                except StopAsyncIteration:
                    self._remaining = 0
                    break
                except Exception as error:
                    item = error
            else:
                item = await self._queue.get()
            if item is self._DONE:
                self._remaining -= 1
                continue
            if isinstance(item, Exception):
                self.cancel()
                if isinstance(item, errors.OpenAIError):
                    raise item
                raise errors.OpenAIError(f"internal error: {item!r}", 500) from item
            return item
        self.finished = not self._cancelled
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._cancelled = True
        self._remaining = 0
        for task in self._tasks:
            task.cancel()
        if self._single_call is not None:  # the generator itself is closed when it is collected
            self._single_call.cancel()
