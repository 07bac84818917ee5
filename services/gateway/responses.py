"""``POST /v1/responses``: OpenAI's Responses API on the chat path.

The request becomes the chat request it means (``instructions`` a system message first, ``input`` a user
message or the conversation's items: messages, ``developer`` read as ``system``; the model's earlier
``function_call`` items as an assistant turn's tool calls, each ``function_call_output`` as a tool message;
function ``tools`` and ``tool_choice`` in chat's shape; ``max_output_tokens`` the completion cap;
``text.format`` the response format), which ``validate_chat`` and ``validate_tools`` check as they check
chat's, and the chat template renders. The answer is chat's answer, read by a ``ChatRenderer`` (tool
calls parsed or forced as chat's are), as output items: a ``message`` of one ``output_text`` part for the
text, a ``function_call`` per call; ``status`` is ``incomplete`` (``max_output_tokens``) when the cap cut
it. Streamed, the events are OpenAI's: ``response.created``, ``response.in_progress``, then per item as
it appears ``response.output_item.added`` (a message's ``response.content_part.added`` and
``response.output_text.delta``s; a call's ``response.function_call_arguments.delta``s), at the end the
``done`` events of each item and ``response.completed`` (or ``response.incomplete``), each event with its
``sequence_number``, and no ``[DONE]``; a failure after the stream began is an ``error`` event and
``response.failed``.

Nothing is stored (``store`` is accepted and answered false): ``previous_response_id`` is refused, so a
client sends the whole conversation each time.
"""

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway import errors, sse
from services.gateway.chat import ChatRenderer, messages_proto
from services.gateway.errors import OpenAIError
from services.gateway.forced_tool_calls import ForcedToolCalls
from services.gateway.generation import Step
from services.gateway.protocol import ERROR_RESPONSES, ChatCompletionRequest, ResponsesRequest
from services.gateway.request_body import JsonBodyRoute
from services.gateway.serving import ChoiceResult, RequestContext, Usage, gateway_state, serve
from services.gateway.structured_output import only_one
from services.gateway.tools import validate_tools
from services.gateway.validation import GenerationParams, validate_chat

router = APIRouter(route_class=JsonBodyRoute)  # bodies read by request_body.py

_TEXT_PARTS = ("input_text", "output_text", "text")
# chat's names for the fields a refusal may name -> this endpoint's
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
_TOOL_FIELDS = ("name", "description", "parameters", "strict")


def _refuse(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise errors.bad_request(message, param=param)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``body`` means (see the module's docstring)."""
    _refuse(body.previous_response_id is None, "previous_response_id is not supported: this server stores no "
            "responses; send the whole conversation as input.", "previous_response_id")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    for i, item in enumerate([{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input):
        message = item if isinstance(item, dict) else _chat_message(item, i, messages)
        if message is not None:
            messages.append(message)
    text_format = body.text.format if body.text is not None else None
    response_format = None
    if text_format is not None and text_format.type != "text":
        response_format = {"type": text_format.type}
        if text_format.type == "json_schema":
            response_format["json_schema"] = {"name": text_format.name, "description": text_format.description,
                                              "schema": text_format.schema_, "strict": text_format.strict}
    tools = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)] if body.tools else None
    tool_choice = body.tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and "name" in tool_choice:
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return ChatCompletionRequest.model_validate({
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "user": body.user,
        "response_format": response_format, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed, "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": body.parallel_tool_calls})


def _chat_message(item, i: int, messages: list[dict]) -> dict | None:
    """Input item ``i`` as a chat message; None where it joins the message before it (a function call
    after another: one assistant turn with both calls)."""
    if item.type == "function_call":
        _refuse(item.call_id is not None and item.name is not None and item.arguments is not None,
                "A function_call input item needs call_id, name and arguments.", f"input[{i}]")
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
            messages[-1]["tool_calls"].append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if item.type == "function_call_output":
        _refuse(item.call_id is not None and item.output is not None,
                "A function_call_output input item needs call_id and output.", f"input[{i}]")
        return {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input[{i}].output")}
    _refuse(item.type == "message" and item.role is not None,
            f"input items of type {item.type!r} are not supported; send messages, function calls and their outputs.",
            f"input[{i}]")
    return {"role": "system" if item.role == "developer" else item.role,
            "content": _text(item.content, f"input[{i}].content") if isinstance(item.content, list) else item.content}


def _text(content, param: str) -> str | list[dict]:
    """Text content parts as chat's text parts (a string stays a string)."""
    if isinstance(content, str):
        return content
    for part in content:
        _refuse(part.type in _TEXT_PARTS and part.text is not None,
                f"Only text content parts are supported, got {part.type!r}.", param)
    return [{"type": "text", "text": part.text} for part in content]


def _chat_tool(tool: dict, i: int) -> dict:
    """A Responses function tool (``{"type": "function", "name", "parameters", ...}``) in chat's shape."""
    _refuse(tool.get("type") == "function", f"Only function tools are supported, got {tool.get('type')!r}.",
            f"tools[{i}]")
    return {"type": "function", "function": {key: tool[key] for key in _TOOL_FIELDS if key in tool}}


class ResponsesRenderer:
    """Chat's answer (read by ``chat``, a ChatRenderer: text, and tool calls parsed or forced) as output items."""
    operation_name = "chat"

    def __init__(self, body: ResponsesRequest, chat: ChatRenderer) -> None:
        self._body = body
        self._chat = chat
        self._sequence = 0

    def response(self, ctx: RequestContext, results: list[ChoiceResult], usage: Usage) -> dict:
        choice = self._chat.full_choice(results[0])
        status = _status(choice["finish_reason"])
        message = choice["message"]
        items = [_function_call(call, "completed") for call in message.get("tool_calls") or []]
        if message.get("reasoning"):
            items.insert(0, _reasoning(f"rs_{uuid.uuid4().hex}", message["reasoning"], "completed"))
        if message.get("content") or not items:
            items.insert(len(items) - len(message.get("tool_calls") or []),
                         _message(f"msg_{uuid.uuid4().hex}", message.get("content") or "", status))
        return self._response(ctx, status, items, usage)

    def stream(self, ctx: RequestContext, params: GenerationParams, usage: Usage, num_choices: int) -> "_ItemEvents":
        return _ItemEvents(self, ctx, usage)

    @staticmethod
    def _open_message(items: list[dict]) -> dict:
        message = {**_message(f"msg_{uuid.uuid4().hex}", "", "in_progress"), "content": []}
        items.append(message)
        return message

    def _opened(self, message: dict, items: list[dict]) -> list[bytes]:
        return [self._event("response.output_item.added", output_index=items.index(message), item=message),
                self._event("response.content_part.added", **self._where(message, items), part=_output_text(""))]

    def _call_events(self, delta: dict, items: list[dict], calls: dict[int, dict]) -> list[bytes]:
        """The events of a chat delta's tool-call pieces: a new call's item, then its arguments' piece."""
        events = []
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function") or {}
            call = calls.get(piece["index"])
            if call is None:
                call = calls[piece["index"]] = _function_call(piece, "in_progress") | {"arguments": ""}
                items.append(call)
                events.append(self._event("response.output_item.added", output_index=len(items) - 1, item=call))
            if function.get("arguments"):
                call["arguments"] += function["arguments"]
                events.append(self._event("response.function_call_arguments.delta", item_id=call["id"],
                                          output_index=items.index(call), delta=function["arguments"]))
        return events

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

    @staticmethod
    def _where(message: dict, items: list[dict]) -> dict:
        return {"item_id": message["id"], "output_index": items.index(message), "content_index": 0}

    def _response(self, ctx: RequestContext, status: str, output: list[dict], usage: Usage | None = None) -> dict:
        body = self._body
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        return {
            "id": ctx.response_id, "object": "response", "created_at": ctx.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": ctx.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": body.temperature, "text": {"format": text_format},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
            "top_p": body.top_p, "truncation": "disabled", "user": body.user, "metadata": body.metadata or {},
            "usage": _usage(usage) if usage is not None else None}


def _message(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [_output_text(text)]}


def _reasoning(item_id: str, text: str, status: str) -> dict:
    """The model's thinking (chat's ``reasoning``) as a ``reasoning`` item: its text, no summary."""
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def _function_call(call: dict, status: str) -> dict:
    """A chat tool call (whole, or a stream's first piece of it) as a ``function_call`` item."""
    function = call.get("function") or {}
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status, "call_id": call.get("id"),
            "name": function.get("name"), "arguments": function.get("arguments") or ""}


class _ItemEvents:
    """One streamed response's events: ``response.created`` and ``in_progress``; per chat delta the
    items it opens and their deltas (reasoning, text, tool calls); at the end each item's ``done``
    events and ``response.completed`` (or ``incomplete``)."""

    def __init__(self, renderer: ResponsesRenderer, ctx: RequestContext, usage: Usage) -> None:
        self._renderer = renderer
        self._ctx = ctx
        self._usage = usage
        self._items: list[dict] = []  # in output order
        self._message: dict | None = None  # the text's item, once there is text
        self._thought: dict | None = None  # the reasoning's item, once there is reasoning (--reasoning-parser)
        self._calls: dict[int, dict] = {}  # by chat's tool-call index
        self._text, self._reasoning, self._finish_reason = "", "", None

    def opening(self) -> list[bytes]:
        r = self._renderer
        events = [r._event("response.created", response=r._response(self._ctx, "in_progress", [])),
                  r._event("response.in_progress", response=r._response(self._ctx, "in_progress", []))]
        for delta in [choice["delta"] for choice in r._chat.preamble([0])]:  # a forced call opens here
            events += r._call_events(delta, self._items, self._calls)
        return events

    def step(self, step: Step) -> list[bytes]:
        r, items = self._renderer, self._items
        choice = r._chat.stream_choice(step)
        if choice is None:
            return []
        events = []
        self._finish_reason = choice["finish_reason"] or self._finish_reason
        delta = choice["delta"]
        if delta.get("reasoning"):
            if self._thought is None:
                self._thought = {**_reasoning(f"rs_{uuid.uuid4().hex}", "", "in_progress"), "content": []}
                items.append(self._thought)
                events.append(r._event("response.output_item.added", output_index=len(items) - 1, item=self._thought))
            self._reasoning += delta["reasoning"]
            events.append(r._event("response.reasoning_text.delta", **r._where(self._thought, items),
                                   delta=delta["reasoning"]))
        if delta.get("content"):
            if self._message is None:
                self._message = r._open_message(items)
                events += r._opened(self._message, items)
            self._text += delta["content"]
            events.append(r._event("response.output_text.delta", **r._where(self._message, items),
                                   delta=delta["content"], logprobs=[]))
        return events + r._call_events(delta, items, self._calls)

    def closing(self) -> list[bytes]:
        r, items, message, thought = self._renderer, self._items, self._message, self._thought
        events = []
        status = _status(self._finish_reason)
        if message is None and not self._calls and thought is None:  # nothing came: an empty message
            message = r._open_message(items)
            events += r._opened(message, items)
        for index, item in enumerate(items):
            if item is message:
                events.append(r._event("response.output_text.done", **r._where(item, items), text=self._text,
                                       logprobs=[]))
                events.append(r._event("response.content_part.done", **r._where(item, items),
                                       part=_output_text(self._text)))
                items[index] = _message(item["id"], self._text, status)
            elif item is thought:
                events.append(r._event("response.reasoning_text.done", **r._where(item, items), text=self._reasoning))
                items[index] = _reasoning(item["id"], self._reasoning, "completed")
            else:
                events.append(r._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]))
                items[index] = {**item, "status": "completed"}
            events.append(r._event("response.output_item.done", output_index=index, item=items[index]))
        events.append(r._event(f"response.{status}", response=r._response(self._ctx, status, items, self._usage)))
        return events

def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Usage) -> dict:
    counts = usage.as_dict()
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": counts.get("completion_tokens_details",
                                                                     {}).get("reasoning_tokens", 0)},
            "total_tokens": counts["total_tokens"]}


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = gateway_state(request)
    facts = await state.upstream.facts()
    ctx = RequestContext(f"resp_{uuid.uuid4().hex}", facts.answering_as(body.model))
    chat = chat_request(body)
    try:
        params = validate_chat(chat, facts, state.limits)
    except OpenAIError as error:  # named as this endpoint names the field
        error.param = _PARAMS.get(error.param, error.param)
        raise
    params.max_tokens_param = "max_output_tokens"
    tool_use = validate_tools(chat, state.tool_call_parser)
    forced = tool_use.forced
    params.constraint = only_one(params.constraint, forced.constraint if forced else None)
    if state.reasoning is not None:
        await state.reasoning.prepare(state.upstream, params)
    prompt = await state.upstream.encode_chat(await messages_proto(chat.messages), True, None,
                                              {"tools": tool_use.tools} if tool_use.tools else {})
    if tool_use.keeps_special_tokens:
        params.skip_special_tokens = False
    renderer = ChatRenderer(state.upstream, False, tool_use.parser,
                            ForcedToolCalls(forced.function_name) if forced else None,
                            reasoning=state.reasoning.tags if state.reasoning else None,
                            parallel_tool_calls=body.parallel_tool_calls is not False)
    return await serve(request, state, facts, ctx, params, [prompt], ResponsesRenderer(body, renderer))
