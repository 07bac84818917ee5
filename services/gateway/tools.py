"""Tool calling (OpenAI ``tools`` / ``tool_choice``), served as vLLM serves it.

The tools reach the chat template as ``tools``, the way transformers passes them; an assistant turn's
``tool_calls`` and a tool turn's ``tool_call_id`` reach it too. Reading calls back out of the model's
text needs a parser for the model's format: ``--tool-call-parser`` names it and
``--enable-auto-tool-choice`` turns it on, as in vLLM, and ``tool_choice: "auto"`` (the default when
tools are given) needs both. ``"required"`` and a named function need guided decoding, which Strata
does not have, so they are refused rather than silently not enforced.

Parsers:
  hermes  Hermes 2 Pro, Qwen2.5, Qwen3: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

import json
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway import errors
from services.gateway.protocol import ChatCompletionRequest

TOOL_CALL_PARSERS = ("hermes",)
_START, _END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolUse:
    """What one chat request does with tools."""
    tools: list[dict[str, Any]] | None  # for the chat template
    parses_calls: bool  # read tool calls out of the generated text


def validate_tools(req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolUse:
    """``tool_call_parser``: the server's parser when auto tool choice is on, else None."""
    if req.tool_choice is not None and not req.tools:
        raise errors.bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    for i, tool in enumerate(req.tools or []):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise errors.bad_request('Each tool must be {"type": "function", "function": {"name": ..., ...}}.',
                                     param=f"tools.[{i}]")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice == "none":
        return ToolUse(req.tools, parses_calls=False)
    if choice == "auto":
        if tool_call_parser is None:
            raise errors.bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                     '--tool-call-parser to be set', param="tool_choice")
        return ToolUse(req.tools, parses_calls=True)
    raise errors.bad_request(f"tool_choice {choice!r} is not supported: forcing a call needs guided decoding, "
                             'which this server does not have; use "auto" or "none".', param="tool_choice")


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished choice's text → (content, tool calls). Content is None when only whitespace surrounds
    the calls; a tagged body that is not a call, or an unfinished one, stays text."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    content += stream.finish()
    return (None if calls and not content.strip() else content), calls


class ToolCallStream:
    """Splits a choice's streamed text into content deltas and finished tool calls (each call sent whole,
    in one delta, with its ``index``). Text that may be the start of a ``<tool_call>`` tag, and the body of
    an open call, are held until they are decided; whitespace after the first call is dropped."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        content, calls = [], []
        while True:
            if not self._in_call:
                start = self._held.find(_START)
                if start < 0:
                    cut = len(self._held) - _partial_tag_length(self._held)
                    content.append(self._text(self._held[:cut]))
                    self._held = self._held[cut:]
                    break
                content.append(self._text(self._held[:start]))
                self._held, self._in_call = self._held[start + len(_START):], True
            else:
                end = self._held.find(_END)
                if end < 0:
                    break
                body, self._held, self._in_call = self._held[:end], self._held[end + len(_END):], False
                call = _tool_call(body, self.num_calls)
                if call is None:
                    content.append(_START + body + _END)
                else:
                    calls.append(call)
                    self.num_calls += 1
        return "".join(content), calls

    def finish(self) -> str:
        """What is still held (a partial tag, an unfinished call), as text."""
        rest = (_START if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return self._text(rest)

    def _text(self, text: str) -> str:
        return "" if self.num_calls and not text.strip() else text


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of ``text`` that a ``<tool_call>`` tag could continue."""
    for length in range(min(len(text), len(_START) - 1), 0, -1):
        if _START.startswith(text[-length:]):
            return length
    return 0


def _tool_call(body: str, index: int) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return {"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}
