"""``POST /v1/completions``: a prompt as text, texts, token ids or lists of token ids; each prompt
gets n choices, numbered prompt_index * n + i. ``echo`` puts the prompt text before the output, and
with ``logprobs`` its tokens' logprobs before the output's (the first token's null, as OpenAI's legacy
API gives them: what lm-evaluation-harness reads for log-likelihoods); vLLM's ``prompt_logprobs`` adds
each choice's ``prompt_logprobs`` in vLLM's shape."""

import asyncio
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway import logprobs as lp
from services.gateway.generation import Step
from services.gateway.protocol import ERROR_RESPONSES, CompletionRequest
from services.gateway.request_body import JsonBodyRoute
from services.gateway.serving import ChoiceRenderer, ChoiceResult, RequestContext, gateway_state, serve
from services.gateway.upstream import Upstream
from services.gateway.validation import completion_prompts, validate_completion

router = APIRouter(route_class=JsonBodyRoute)  # bodies read by request_body.py


class CompletionRenderer(ChoiceRenderer):
    chunk_object = "text_completion"
    response_object = "text_completion"
    operation_name = "text_completion"

    def __init__(self, upstream: Upstream, with_logprobs: bool, echo_texts: list[str] | None,
                 n: int, *, prompts: list[list[int]] | None = None, num_echo_top: int | None = None,
                 num_prompt_logprobs: int | None = None, echo_only: bool = False) -> None:
        """``prompts``: the prompts' ids (for the two below); ``num_echo_top``: the echoed prompt's tokens
        lead each choice's ``logprobs``, with this many alternatives (echo with logprobs);
        ``num_prompt_logprobs``: each choice carries vLLM's ``prompt_logprobs`` with this many;
        ``echo_only``: echo with max_tokens 0, each choice the prompt alone (the token generated is not shown)."""
        self._echo_only = echo_only
        self._upstream = upstream
        self._with_logprobs = with_logprobs
        self._echo_texts = echo_texts
        self._n = n
        self._prompts = prompts
        self._num_echo_top = num_echo_top
        self._num_prompt_logprobs = num_prompt_logprobs
        self._streamed_logprobs: dict[int, lp.CompletionLogprobs] = {}

    def _echo(self, index: int) -> str:
        return self._echo_texts[index // self._n] if self._echo_texts else ""

    def _output_offset(self, index: int) -> int:
        """Where the output's ``text_offset`` starts: after the echoed prompt's tokens, whose offsets count
        their token strings as vLLM's do (a special token's string, the replacement characters of a token
        that ends mid UTF-8 character), so every offset is the previous one plus its token's length."""
        if self._num_echo_top is None:
            return len(self._echo(index))
        prompt = self._prompts[index // self._n]
        texts = self.token_texts(set(prompt))
        return sum(len(texts[token_id]) for token_id in prompt)

    def _format(self, builder: lp.CompletionLogprobs, entries: list) -> dict:
        return builder.format(entries, self.token_texts(lp.token_ids_of(entries)))

    def _with_prompt(self, index: int, prompt_entries: list, logprobs: dict | None) -> dict | None:
        """``logprobs`` led by the echoed prompt's tokens, when echo asked for logprobs."""
        if self._num_echo_top is None:
            return logprobs
        first_id = self._prompts[index // self._n][0]
        texts = self.token_texts(lp.token_ids_of(prompt_entries) | {first_id})
        prompt = lp.CompletionLogprobs(0).format(prompt_entries, texts, first_id, self._num_echo_top)
        return {key: prompt[key] + (logprobs[key] if logprobs else []) for key in prompt}

    def preamble(self, indices: list[int]) -> list[dict]:
        if not self._echo_texts:
            return []
        return [{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}
                for i in indices]

    def stream_choice(self, step: Step) -> dict | None:
        has_logprobs = self._with_logprobs and bool(step.logprobs)
        if not step.text and not step.token_ids and step.finish_reason is None and not has_logprobs:
            return None  # (a step with tokens whose text does not show yet still gets its chunk, as in vLLM)
        logprobs = None
        if self._echo_only:
            if has_logprobs and step.completion_tokens == len(step.token_ids):
                logprobs = self._with_prompt(step.index, step.prompt_logprobs, None)
            step = replace(step, text="")
        elif has_logprobs:
            builder = self._streamed_logprobs.setdefault(
                step.index, lp.CompletionLogprobs(self._output_offset(step.index)))
            logprobs = self._format(builder, step.logprobs)
            if step.completion_tokens == len(step.token_ids):  # the choice's first step
                logprobs = self._with_prompt(step.index, step.prompt_logprobs, logprobs)
        choice = {"index": step.index, "text": step.text, "logprobs": logprobs,
                  "finish_reason": step.finish_reason}
        if step.finish_reason is not None:
            choice["stop_reason"] = step.stop_reason
        return choice

    def full_choice(self, result: ChoiceResult) -> dict:
        echo = self._echo(result.index)
        logprobs = None
        if self._echo_only:
            if self._with_logprobs:
                logprobs = self._with_prompt(result.index, result.prompt_logprobs, None)
            result = replace(result, text="")
        elif self._with_logprobs:
            logprobs = self._with_prompt(result.index, result.prompt_logprobs,
                                         self._format(lp.CompletionLogprobs(self._output_offset(result.index)),
                                                      result.logprobs))
        choice = {"index": result.index, "text": echo + result.text, "logprobs": logprobs,
                  "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}
        if self._num_prompt_logprobs is not None:
            texts = self._upstream.token_texts(lp.token_ids_of(result.prompt_logprobs))
            choice["prompt_logprobs"] = lp.prompt_logprobs(result.prompt_logprobs, texts, self._num_prompt_logprobs)
        return choice


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = gateway_state(request)
    facts = await state.upstream.facts()
    ctx = RequestContext.new("cmpl", facts.answering_as(body.model))
    params = validate_completion(body, facts, state.limits)
    raw_prompts = completion_prompts(body)

    async def tokenize(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await state.upstream.encode(prompt, body.add_special_tokens)
        return prompt

    prompts = list(await asyncio.gather(*(tokenize(p) for p in raw_prompts)))
    echo_texts = None
    if params.echo:
        async def prompt_text(prompt: str | list[int]) -> str:
            if isinstance(prompt, str):
                return prompt
            return await state.upstream.decode(prompt, params.skip_special_tokens)
        echo_texts = list(await asyncio.gather(*(prompt_text(p) for p in raw_prompts)))
    renderer = CompletionRenderer(state.upstream, params.num_logprobs is not None, echo_texts, params.n,
                                  prompts=prompts, num_echo_top=params.num_logprobs if params.echo else None,
                                  num_prompt_logprobs=body.prompt_logprobs,  # vLLM's field, when asked for
                                  echo_only=params.echo_only)
    renderer.tokens_as_ids = body.return_tokens_as_token_ids
    return await serve(request, state, facts, ctx, params, prompts, renderer)
