"""``POST /v1/completions``: a prompt as text, texts, token ids or lists of token ids; each prompt
gets n choices, numbered prompt_index * n + i. ``echo`` puts the prompt text before the output."""

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway import logprobs as lp
from services.gateway.generation import Step
from services.gateway.protocol import ERROR_RESPONSES, CompletionRequest
from services.gateway.request_body import JsonBodyRoute
from services.gateway.serving import ChoiceResult, RequestContext, gateway_state, serve
from services.gateway.upstream import Upstream
from services.gateway.validation import completion_prompts, validate_completion

router = APIRouter(route_class=JsonBodyRoute)  # bodies read by request_body.py


class CompletionRenderer:
    chunk_object = "text_completion"
    response_object = "text_completion"
    operation_name = "text_completion"

    def __init__(self, upstream: Upstream, with_logprobs: bool, echo_texts: list[str] | None,
                 n: int) -> None:
        self._upstream = upstream
        self._with_logprobs = with_logprobs
        self._echo_texts = echo_texts
        self._n = n
        self._streamed_logprobs: dict[int, lp.CompletionLogprobs] = {}

    def _echo(self, index: int) -> str:
        return self._echo_texts[index // self._n] if self._echo_texts else ""

    def _format(self, builder: lp.CompletionLogprobs, entries: list) -> dict:
        texts = self._upstream.token_texts(lp.token_ids_of(entries))
        return builder.format(entries, texts)

    def preamble(self, indices: list[int]) -> list[dict]:
        if not self._echo_texts:
            return []
        return [{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}
                for i in indices]

    def stream_choice(self, step: Step) -> dict | None:
        has_logprobs = self._with_logprobs and bool(step.logprobs)
        if not step.text and step.finish_reason is None and not has_logprobs:
            return None
        logprobs = None
        if has_logprobs:
            builder = self._streamed_logprobs.setdefault(
                step.index, lp.CompletionLogprobs(len(self._echo(step.index))))
            logprobs = self._format(builder, step.logprobs)
        choice = {"index": step.index, "text": step.text, "logprobs": logprobs,
                  "finish_reason": step.finish_reason}
        if step.finish_reason is not None:
            choice["stop_reason"] = step.stop_reason
        return choice

    def full_choice(self, result: ChoiceResult) -> dict:
        echo = self._echo(result.index)
        logprobs = None
        if self._with_logprobs:
            logprobs = self._format(lp.CompletionLogprobs(len(echo)), result.logprobs)
        return {"index": result.index, "text": echo + result.text, "logprobs": logprobs,
                "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = gateway_state(request)
    facts = await state.upstream.facts()
    ctx = RequestContext.new("cmpl", facts.name)
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
    renderer = CompletionRenderer(state.upstream, params.num_logprobs is not None, echo_texts, params.n)
    return await serve(request, state, facts, ctx, params, prompts, renderer)
