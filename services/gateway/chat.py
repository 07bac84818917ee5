"""``POST /v1/chat/completions``: messages -> the tokenizer's chat template -> choices, in the
chat shapes (first streamed delta of each choice carries ``role: assistant``)."""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.common.pb import tokenizer_pb2
from services.gateway import logprobs as lp
from services.gateway.generation import Step
from services.gateway.protocol import ChatCompletionRequest, ContentPart
from services.gateway.serving import ChoiceResult, RequestContext, gateway_state, serve
from services.gateway.upstream import Upstream
from services.gateway.validation import validate_chat

router = APIRouter()


class ChatRenderer:
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, upstream: Upstream, with_logprobs: bool) -> None:
        self._upstream = upstream
        self._with_logprobs = with_logprobs

    async def _logprobs(self, entries: list) -> dict | None:
        if not self._with_logprobs:
            return None
        texts = await self._upstream.token_texts(lp.token_ids_of(entries))
        return {"content": lp.chat_content(entries, texts)}

    def preamble(self, indices: list[int]) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in indices]

    async def stream_choice(self, step: Step) -> dict | None:
        has_logprobs = self._with_logprobs and bool(step.logprobs)
        if not step.text and step.finish_reason is None and not has_logprobs:
            return None
        delta = {"content": step.text} if step.text or has_logprobs else {}
        choice = {"index": step.index, "delta": delta,
                  "logprobs": await self._logprobs(step.logprobs) if has_logprobs else None,
                  "finish_reason": step.finish_reason}
        if step.finish_reason is not None:
            choice["stop_reason"] = step.stop_reason
        return choice

    async def full_choice(self, result: ChoiceResult) -> dict:
        return {"index": result.index, "message": {"role": "assistant", "content": result.text},
                "logprobs": await self._logprobs(result.logprobs),
                "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}


def _flatten(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text or "" for part in content)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = gateway_state(request)
    facts = await state.upstream.facts()
    ctx = RequestContext.new("chatcmpl", facts.name)
    params = validate_chat(body, facts, state.limits)
    messages = [tokenizer_pb2.ChatMessage(role=m.role, content=_flatten(m.content), name=m.name)
                for m in body.messages]
    prompt = await state.upstream.encode_chat(messages, body.add_generation_prompt,
                                              body.chat_template, body.chat_template_kwargs)
    renderer = ChatRenderer(state.upstream, params.num_logprobs is not None)
    return await serve(request, state.upstream, state.metrics, facts, ctx, params, [prompt], renderer)
