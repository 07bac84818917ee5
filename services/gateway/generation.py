"""One request's choices: n Generate streams per prompt, each detokenized here with the tokenizer's
decoder (`Upstream.decoder`) and cut at stop strings, handed on as ``Step``s as they arrive.

Contract: a `StepSink` gets every choice's steps in arrival order, each choice's last one with a
``finish_reason``, then ``end()``; or, where the generation fails, ``fail(error)`` once (no call
after it). Cancelling (``FanOut.cancel()``, a client disconnect, or a stop string) cancels that
choice's Generate call, which aborts the request in the engine and frees its KV blocks.

The steps are pushed, not awaited: a choice on the shared GenerateMany stream
(`SharedGenerateCall.listen`) is decoded, cut and handed on inside the reading of the engine's reply,
no task woken per token; a choice on a Generate call of its own is read by a task of its own.
"""

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from opentelemetry.trace import Span

from services.common.pb import engine_pb2
from services.common.shared_generate import SharedGenerateCall
from services.gateway import errors, genai_span
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.upstream import Upstream
from services.gateway.validation import GenerationParams

log = logging.getLogger(__name__)

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


class StepSink(Protocol):
    """Where a request's steps go (the stream's events, or the response being collected)."""

    def step(self, step: Step) -> None:
        """A choice's new output."""

    def end(self) -> None:
        """Every choice has finished."""

    def fail(self, error: errors.OpenAIError) -> None:
        """The generation failed; every choice was cancelled."""


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


class ChoiceDecoder:
    """One choice's engine outputs as steps: each output's ids become text as soon as it is read,
    cut at the first stop string. ``finished`` once it returned the choice's last step."""

    def __init__(self, upstream: Upstream, spec: ChoiceSpec, params: GenerationParams,
                 eos_token_ids: frozenset[int], span: Span) -> None:
        self._spec = spec
        self._params = params
        self._eos_token_ids = eos_token_ids
        self._span = span  # the request's, for the stop string's event
        self._detokenizer = upstream.decoder.detokenizer(params.skip_special_tokens,
                                                         spec.prompt_ids[-_DETOKENIZE_PREFIX_IDS:])
        # (none without stop strings: every token's text goes out as it comes)
        self._matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._num_tokens = 0
        # the usage as of the last output (a next_token entry's is one completion token more)
        self._prompt_tokens, self._completion_tokens, self._cached_tokens = len(spec.prompt_ids), 0, 0
        self.finished = False

    def feed(self, output: engine_pb2.GenerateResponse) -> Step:
        """The output as a step. Each of the output's fields is read once (a protobuf field read builds a
        new Python object each time)."""
        token_ids = list(output.token_ids)
        finish = _FINISH_REASONS.get(output.finish_reason)
        stop_token_id = output.stop_token_id if finish is not None and output.HasField("stop_token_id") else None
        usage = output.usage
        self._prompt_tokens = usage.prompt_tokens or len(self._spec.prompt_ids)
        self._completion_tokens = usage.completion_tokens or self._num_tokens + len(token_ids)
        self._cached_tokens = usage.cached_prompt_tokens
        logprobs = output.logprobs
        step = self._step(token_ids, finish, stop_token_id, list(logprobs) if logprobs else [])  # most ask for none
        if output.prompt_logprobs:
            step.prompt_logprobs = list(output.prompt_logprobs)
        return step

    def feed_token(self, token_id: int) -> Step:
        """A `next_token` entry as a step: an output of this one token, its usage one completion token
        past the last output's. Runs once per choice and token."""
        self._completion_tokens += 1
        return self._step([token_id], None, None, [])

    def _step(self, token_ids: list[int], finish: str | None, stop_token_id: int | None,
              logprobs: list[engine_pb2.SampledLogprobs]) -> Step:
        params, spec = self._params, self._spec
        self._num_tokens += len(token_ids)
        if finish is None:
            text = self._detokenizer.step(token_ids)
        else:
            text = self._detokenizer.step(_rendered_ids(token_ids, finish, stop_token_id is not None, params,
                                                        self._eos_token_ids))
            text += self._detokenizer.flush()
        stop = None
        if self._matcher is not None:
            match = self._matcher.feed(text, can_stop=self._num_tokens >= params.min_tokens)
            text, stop = match.text, match.stop
        step = Step(spec.index, text, token_ids, logprobs, prompt_tokens=self._prompt_tokens,
                    completion_tokens=self._completion_tokens, cached_tokens=self._cached_tokens)
        if stop is not None:
            step.finish_reason, step.stop_reason = "stop", stop
            self._span.add_event(genai_span.STAGE_STOP_STRING, {
                "gen_ai.choice.index": spec.index, "strata.stop_string": stop})
        elif finish is not None:
            if self._matcher is not None:
                step.text += self._matcher.flush()
            step.finish_reason = finish
            if stop_token_id is not None:  # (generation_config.json's extra EOS ids too, as vLLM)
                step.stop_reason = stop_token_id
        self.finished = step.finish_reason is not None
        return step


def _rendered_ids(token_ids: list[int], finish: str | None, ends_on_stop_token: bool, params: GenerationParams,
                  eos_token_ids: frozenset[int]) -> list[int]:
    """The output's ids whose text the answer shows: not the EOS or stop token that ended it (whose text
    a client sees only with include_stop_str_in_output, or as nothing when special tokens are skipped),
    as vLLM renders it."""
    if finish == "stop" and token_ids and not params.include_stop_str_in_output \
            and (ends_on_stop_token or token_ids[-1] in eos_token_ids):
        return token_ids[:-1]
    return token_ids


_ENDED_EARLY = "engine ended the stream without a finish reason"


class FanOut:
    """Starts every choice's Generate call and hands their steps to ``sink`` as they arrive (see the
    module). ``cancel()`` is synchronous so it also works from a cancelled task's cleanup."""

    def __init__(self, upstream: Upstream, specs: list[ChoiceSpec], params: GenerationParams,
                 eos_token_ids: frozenset[int], sink: StepSink, span: Span) -> None:
        self._sink = sink
        self._params = params
        self._calls = []
        self._readers: list[asyncio.Task] = []
        self._remaining = len(specs)
        self._over = False  # ended, failed or cancelled: nothing more reaches the sink
        self.finished = False  # every choice ran to its finish step
        for spec in specs:
            call = upstream.generate(spec.request)
            self._calls.append(call)
            decoder = ChoiceDecoder(upstream, spec, params, eos_token_ids, span)
            request_id = spec.request.request_id
            deliver = functools.partial(self._deliver, call, decoder, decoder.feed, request_id)
            if isinstance(call, SharedGenerateCall):
                call.listen(deliver, functools.partial(self._deliver, call, decoder, decoder.feed_token, request_id))
            else:
                self._readers.append(asyncio.create_task(_read(call, deliver)))

    def _deliver(self, call, decoder: ChoiceDecoder, feed: Callable[[object], Step], request_id: str,
                 item: engine_pb2.GenerateResponse | int | Exception) -> None:
        """One output of the choice's call (``feed`` makes it a step: an output, or a token id alone), or
        the error that ended it."""
        if self._over or decoder.finished:
            return
        try:  # never raises: it runs inside the reading of a stream that other requests share
            if isinstance(item, Exception):
                raise item
            step = feed(item)
            if decoder.finished:
                call.cancel()  # (a stop string: the engine would go on)
                self._remaining -= 1
            self._sink.step(step)
            if not self._remaining:
                self._over = self.finished = True
                self._sink.end()
        except Exception as error:
            self._fail(error, request_id)

    def _fail(self, error: Exception, request_id: str) -> None:
        if isinstance(error, grpc.RpcError):
            error = errors.from_grpc(error, "engine")
        elif not isinstance(error, errors.OpenAIError):  # a bug: the client still gets an error
            log.error("%s: the generation failed: %s: %s", request_id, type(error).__name__, error, exc_info=error)
            error = errors.OpenAIError(f"Internal server error: {type(error).__name__}: {error}", 500)
        if error.status == 400:  # a refusal names the client's field, not the engine's
            error.param = self._params.request_param(error.param)
        self.cancel()
        try:
            self._sink.fail(error)
        except Exception as bug:  # (in rendering the error: the response ends without it)
            log.error("%s: the failure could not be answered: %s: %s", request_id, type(bug).__name__, bug,
                      exc_info=bug)

    def cancel(self) -> None:
        self._over = True
        for reader in self._readers:
            reader.cancel()
        for call in self._calls:
            call.cancel()


async def _read(call, deliver: Callable[[object], None]) -> None:
    """Reads a Generate call of its own and hands each output on."""
    try:
        async for output in call:
            deliver(output)
        deliver(errors.OpenAIError(_ENDED_EARLY, 502))  # (ignored after the finish step)
    except Exception as error:
        deliver(error)
