"""``POST /v1/responses``: OpenAI's Responses API, text in and text out, on the chat path.

The request becomes the chat request it means (``instructions`` a system message first, ``input`` a user
message or the conversation's messages, ``developer`` read as ``system``, ``max_output_tokens`` the
completion cap, ``text.format`` the response format), which ``validate_chat`` checks as it checks chat's,
and the chat template renders. The answer is one ``message`` output item holding one ``output_text``
part; ``status`` is ``incomplete`` (``max_output_tokens``) when the cap cut it. Streamed, the events are
OpenAI's: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per piece of text, then the ``done`` events
in reverse and ``response.completed`` (or ``response.incomplete``), each with its ``sequence_number``, and
no ``[DONE]``; a failure after the stream began is an ``error`` event and ``response.failed``.

Nothing is stored (``store`` is accepted and answered false): ``previous_response_id`` is refused, so a
client sends the whole conversation each time. Tools are refused here (chat completions serves them).
"""

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway import errors, sse
from services.gateway.chat import messages_proto
from services.gateway.errors import OpenAIError
from services.gateway.generation import Step
from services.gateway.protocol import ERROR_RESPONSES, ChatCompletionRequest, ResponsesRequest
from services.gateway.request_body import JsonBodyRoute
from services.gateway.serving import ChoiceResult, RequestContext, Usage, gateway_state, serve
from services.gateway.validation import GenerationParams, validate_chat

router = APIRouter(route_class=JsonBodyRoute)  # bodies read by request_body.py

_TEXT_PARTS = ("input_text", "output_text", "text")
# chat's names for the fields a refusal may name -> this endpoint's
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


def _refuse(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise errors.bad_request(message, param=param)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``body`` means (see the module's docstring)."""
    _refuse(body.previous_response_id is None, "previous_response_id is not supported: this server stores no "
            "responses; send the whole conversation as input.", "previous_response_id")
    _refuse(not body.tools, "tools are not supported on /v1/responses; use /v1/chat/completions.", "tools")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            _refuse(item.type == "message" and item.role is not None,
                    f"input items of type {item.type!r} are not supported; send messages (role and content).",
                    f"input[{i}]")
            content = item.content
            if isinstance(content, list):
                for part in content:
                    _refuse(part.type in _TEXT_PARTS and part.text is not None,
                            f"Only text content parts are supported, got {part.type!r}.", f"input[{i}].content")
                content = [{"type": "text", "text": part.text} for part in content]
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": content})
    text_format = body.text.format if body.text is not None else None
    response_format = None
    if text_format is not None and text_format.type != "text":
        response_format = {"type": text_format.type}
        if text_format.type == "json_schema":
            response_format["json_schema"] = {"name": text_format.name, "description": text_format.description,
                                              "schema": text_format.schema_, "strict": text_format.strict}
    return ChatCompletionRequest.model_validate({
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "user": body.user,
        "response_format": response_format, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed})


class ResponsesRenderer:
    operation_name = "chat"

    def __init__(self, body: ResponsesRequest) -> None:
        self._body = body
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._sequence = 0

    def response(self, ctx: RequestContext, results: list[ChoiceResult], usage: Usage) -> dict:
        result = results[0]
        status = _status(result.finish_reason)
        return self._response(ctx, status, [self._message(result.text, status)], usage)

    async def events(self, ctx: RequestContext, params: GenerationParams, steps, usage: Usage, num_choices: int):
        yield self._event("response.created", response=self._response(ctx, "in_progress", []))
        yield self._event("response.in_progress", response=self._response(ctx, "in_progress", []))
        yield self._event("response.output_item.added", output_index=0,
                          item={**self._message("", "in_progress"), "content": []})
        where = {"item_id": self._message_id, "output_index": 0, "content_index": 0}
        yield self._event("response.content_part.added", **where, part=_output_text(""))
        text, finish_reason = "", None
        step: Step
        async for step in steps:
            if step.text:
                text += step.text
                yield self._event("response.output_text.delta", **where, delta=step.text, logprobs=[])
            finish_reason = step.finish_reason or finish_reason
        status = _status(finish_reason)
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, part=_output_text(text))
        message = self._message(text, status)
        yield self._event("response.output_item.done", output_index=0, item=message)
        yield self._event(f"response.{status}", response=self._response(ctx, status, [message], usage))

    def error_events(self, error: OpenAIError) -> list[bytes]:
        detail = error.body()["error"]
        return [self._event("error", code=detail["code"] or detail["type"], message=detail["message"],
                            param=detail["param"]),
                self._event("response.failed", response={"status": "failed", "error": {
                    "code": detail["code"] or detail["type"], "message": detail["message"]}})]

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse.event(payload)

    def _message(self, text: str, status: str) -> dict:
        return {"id": self._message_id, "type": "message", "status": status, "role": "assistant",
                "content": [_output_text(text)]}

    def _response(self, ctx: RequestContext, status: str, output: list[dict], usage: Usage | None = None) -> dict:
        body = self._body
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        return {
            "id": ctx.response_id, "object": "response", "created_at": ctx.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": ctx.model,
            "output": output, "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": body.temperature, "text": {"format": text_format}, "tool_choice": "auto",
            "tools": [], "top_p": body.top_p, "truncation": "disabled", "user": body.user,
            "metadata": body.metadata or {}, "usage": _usage(usage) if usage is not None else None}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Usage) -> dict:
    counts = usage.as_dict()
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"]}


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = gateway_state(request)
    facts = await state.upstream.facts()
    ctx = RequestContext(f"resp_{uuid.uuid4().hex}", facts.name)
    chat = chat_request(body)
    try:
        params = validate_chat(chat, facts, state.limits)
    except OpenAIError as error:  # named as this endpoint names the field
        error.param = _PARAMS.get(error.param, error.param)
        raise
    params.max_tokens_param = "max_output_tokens"
    prompt = await state.upstream.encode_chat(await messages_proto(chat.messages), True, None, {})
    return await serve(request, state, facts, ctx, params, [prompt], ResponsesRenderer(body))
