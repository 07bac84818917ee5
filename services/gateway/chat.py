"""``POST /v1/chat/completions``: messages -> the tokenizer's chat template -> choices, in the
chat shapes (first streamed delta of each choice carries ``role: assistant``)."""

import asyncio
import dataclasses
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.common.pb import tokenizer_pb2
from services.gateway import logprobs as lp
from services.gateway.forced_tool_calls import ForcedToolCalls
from services.gateway.generation import Step
from services.gateway.protocol import ERROR_RESPONSES, ChatCompletionRequest, ChatMessage, ContentPart
from services.gateway.reasoning import ReasoningStream, ReasoningTags, split_reasoning
from services.gateway.request_body import JsonBodyRoute
from services.gateway.serving import ChoiceRenderer, ChoiceResult, RequestContext, gateway_state, serve
from services.gateway.structured_output import only_one
from services.gateway.tool_parsers import ToolCallStream, parse_tool_calls, tool_call_stream
from services.gateway.tools import validate_tools
from services.gateway.upstream import Upstream
from services.gateway.validation import validate_chat

router = APIRouter(route_class=JsonBodyRoute)  # bodies read by request_body.py


class ChatRenderer(ChoiceRenderer):
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"
    operation_name = "chat"

    def __init__(self, upstream: Upstream, with_logprobs: bool, tool_parser: str | None = None,
                 forced_tool_calls: ForcedToolCalls | None = None, num_prompt_logprobs: int | None = None,
                 reasoning: ReasoningTags | None = None, include_reasoning: bool = True, echo: str = "",
                 parallel_tool_calls: bool = True) -> None:
        """``num_prompt_logprobs``: the response carries vLLM's ``prompt_logprobs`` with this many alternatives.
        ``reasoning``: the model thinks between these tags (`reasoning.py`); what it thinks is the message's
        ``reasoning`` (dropped without ``include_reasoning``), and the rest is read as the answer. ``echo``:
        the content starts with it (vLLM's chat ``echo``: the assistant message the request ended with).
        Without ``parallel_tool_calls``, a choice's first parsed tool call is its only one (as vLLM drops the rest)."""
        self._upstream = upstream
        self._num_prompt_logprobs = num_prompt_logprobs
        self._with_logprobs = with_logprobs
        self._tool_parser = tool_parser  # reads tool calls out of the answer (tool_parsers); None: none
        self._tool_streams: dict[int, ToolCallStream] = {}  # by choice index
        self._forced = forced_tool_calls
        self._reasoning = reasoning
        self._include_reasoning = include_reasoning
        self._reasoning_streams: dict[int, ReasoningStream] = {}  # by choice index
        self._echo = echo
        self._max_tool_calls = None if parallel_tool_calls else 1

    def _logprobs(self, entries: list) -> dict | None:
        if not self._with_logprobs:
            return None
        return {"content": lp.chat_content(entries, self.token_texts(lp.token_ids_of(entries)))}

    def preamble(self, indices: list[int]) -> list[dict]:
        def first_delta(index: int) -> dict:
            return self._forced.first_delta(index) if self._forced else {"role": "assistant", "content": self._echo}
        return [{"index": i, "delta": first_delta(i), "logprobs": None, "finish_reason": None} for i in indices]

    def stream_choice(self, step: Step) -> dict | None:
        has_logprobs = self._with_logprobs and bool(step.logprobs)
        reasoning = ""
        if self._reasoning is not None:
            reasoning, answer = self._split_stream(step)
            step = dataclasses.replace(step, text=answer)
        if self._forced is not None:
            delta, finish_reason = self._forced.stream_delta(step.index, step.text, step.finish_reason)
        else:
            delta, finish_reason = self._content_delta(step, has_logprobs and not reasoning)
        if reasoning and self._include_reasoning:
            delta = {**_reasoning_fields(reasoning), **delta}
        if not delta and finish_reason is None and not has_logprobs:
            return None
        choice = {"index": step.index, "delta": delta,
                  "logprobs": self._logprobs(step.logprobs) if has_logprobs else None,
                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = step.stop_reason
        return choice

    def _split_stream(self, step: Step) -> tuple[str, str]:
        """The step's text as (reasoning, answer), at the end of the output with what was held back."""
        stream = self._reasoning_streams.setdefault(step.index, ReasoningStream(self._reasoning))
        reasoning, answer = stream.feed(step.text)
        if step.finish_reason is not None:
            held_reasoning, held_answer = stream.finish()
            reasoning, answer = reasoning + held_reasoning, answer + held_answer
        return reasoning, answer

    def _content_delta(self, step: Step, has_logprobs: bool) -> tuple[dict, str | None]:
        """The text as content, less any tool calls the auto tool parser reads out of it."""
        text, tool_calls, finish_reason = step.text, [], step.finish_reason
        if self._tool_parser is not None:
            stream = self._tool_streams.setdefault(step.index, tool_call_stream(self._tool_parser))
            text, tool_calls = stream.feed(step.text)
            if finish_reason is not None:
                rest, last_calls = stream.finish()
                text, tool_calls = text + rest, tool_calls + last_calls
                finish_reason = _with_tool_calls(finish_reason, stream.num_calls)
            if self._max_tool_calls is not None:
                tool_calls = [call for call in tool_calls if call["index"] < self._max_tool_calls]
        # A step's tokens get a chunk even where their text does not show yet (a special token, half a
        # UTF-8 character, a possible stop string held back), as vLLM sends one; not while a parser holds
        # the text back to read tool calls out of it.
        shows_tokens = bool(step.token_ids) and self._tool_parser is None and self._reasoning is None
        delta = {"content": text} if text or has_logprobs or shows_tokens else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta, finish_reason

    def full_choice(self, result: ChoiceResult) -> dict:
        text, reasoning = result.text, None
        if self._reasoning is not None:
            reasoning, text = split_reasoning(text, self._reasoning)
        message = {"role": "assistant", "content": text}
        finish_reason = result.finish_reason
        if self._forced is not None:
            message, finish_reason = self._forced.message(text or "", finish_reason)
        elif self._tool_parser is not None:
            content, calls = parse_tool_calls(text or "", self._tool_parser)
            calls = calls[:self._max_tool_calls]
            message = {"role": "assistant", "content": content,
                       "tool_calls": [{k: v for k, v in call.items() if k != "index"} for call in calls]}
            finish_reason = _with_tool_calls(finish_reason, len(calls))
        if self._echo and self._forced is None:
            message["content"] = self._echo + (message["content"] or "")
        if self._reasoning is not None and self._include_reasoning:
            message = {"role": "assistant", **_reasoning_fields(reasoning), **message}
        return {"index": result.index, "message": message, "logprobs": self._logprobs(result.logprobs),
                "finish_reason": finish_reason, "stop_reason": result.stop_reason}

    def response_fields(self, results: list[ChoiceResult]) -> dict:
        if self._num_prompt_logprobs is None:
            return {}
        entries = results[0].prompt_logprobs  # every choice has the one prompt
        texts = self._upstream.token_texts(lp.token_ids_of(entries))
        return {"prompt_logprobs": lp.prompt_logprobs(entries, texts, self._num_prompt_logprobs)}


def _reasoning_fields(reasoning: str | None) -> dict:
    """vLLM's ``reasoning`` and its former name ``reasoning_content``, which DeepSeek's API uses."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def _with_tool_calls(finish_reason: str | None, num_calls: int) -> str | None:
    """A turn that ends by itself after calling tools finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the answer starts with the request's last message where that is the assistant's."""
    last = body.messages[-1] if body.messages else None
    return _flatten(last.content) if body.echo and last is not None and last.role == "assistant" else ""


def _flatten(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text or "" for part in content)


def _message_proto(message: ChatMessage) -> tokenizer_pb2.ChatMessage:
    return tokenizer_pb2.ChatMessage(
        role=message.role, content=_flatten(message.content), name=message.name,
        tool_call_id=message.tool_call_id,
        tool_calls=[tokenizer_pb2.ToolCall(id=call.id, type=call.type, function=tokenizer_pb2.FunctionCall(
            name=call.function.name, arguments=call.function.arguments if isinstance(call.function.arguments, str)
            else json.dumps(call.function.arguments))) for call in message.tool_calls or ()])


async def messages_proto(messages: list[ChatMessage]) -> list[tokenizer_pb2.ChatMessage]:
    """The messages as protobuf, yielding to the event loop every 1024 (100k messages take 0.25 s)."""
    protos = []
    for i, message in enumerate(messages):
        if i % 1024 == 1023:
            await asyncio.sleep(0)
        protos.append(_message_proto(message))
    return protos


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = gateway_state(request)
    facts = await state.upstream.facts()
    ctx = RequestContext.new("chatcmpl", facts.answering_as(body.model))
    params = validate_chat(body, facts, state.limits)
    tool_use = validate_tools(body, state.tool_call_parser)
    forced = tool_use.forced
    params.constraint = only_one(params.constraint, forced.constraint if forced else None)
    if state.reasoning is not None:
        await state.reasoning.prepare(state.upstream, params)
    messages = await messages_proto(body.messages)
    # the request's tools reach the template as transformers passes them; chat_template_kwargs win
    template_kwargs = {**({"tools": tool_use.tools} if tool_use.tools else {}), **(body.chat_template_kwargs or {})}
    prompt = await state.upstream.encode_chat(messages, body.add_generation_prompt,
                                              body.chat_template, template_kwargs, body.continue_final_message)
    if tool_use.keeps_special_tokens:
        params.skip_special_tokens = False
    renderer = ChatRenderer(state.upstream, params.num_logprobs is not None, tool_use.parser,
                            ForcedToolCalls(forced.function_name) if forced else None, body.prompt_logprobs,
                            state.reasoning.tags if state.reasoning else None, body.include_reasoning,
                            _echoed(body), body.parallel_tool_calls is not False)
    renderer.tokens_as_ids = body.return_tokens_as_token_ids
    return await serve(request, state, facts, ctx, params, [prompt], renderer)
