"""The output of a forced tool choice (``tools.ForcedToolChoice``) read back as tool calls.

A named function: the output is the call's arguments. Streamed, the first delta of a choice opens the
call (index 0, id, type, name, arguments ``""``) as OpenAI's does, and each later delta carries a piece
of the arguments; the choice finishes with the engine's reason ("stop", as OpenAI's forced calls do).

"required": the output is a JSON array of ``{"name", "parameters"}``. Each call goes out whole, in one
delta, as soon as its object is complete, and the choice finishes with "tool_calls" (or "length" when
cut). A call cut short by ``max_tokens`` is dropped; the finish reason says so.

Either way the message's ``content`` is null.
"""

import json
from typing import Any

from services.gateway.tool_parsers import new_tool_call_id

_DECODER = json.JSONDecoder()


class ForcedToolCalls:
    """The tool calls of every choice of one request, by choice index."""

    def __init__(self, function_name: str | None) -> None:
        """``function_name``: the named function, or None for "required"."""
        self._name = function_name
        self._arrays: dict[int, _CallArray] = {}

    def first_delta(self, index: int) -> dict[str, Any]:
        """The delta that opens choice ``index``'s stream."""
        delta: dict[str, Any] = {"role": "assistant", "content": None}
        if self._name is not None:
            delta["tool_calls"] = [{"index": 0, **self._named_call("")}]
        return delta

    def stream_delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta of one streamed step of choice ``index`` (``{}`` for nothing new) and its finish reason."""
        if self._name is not None:
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), finish_reason
        array = self._arrays.setdefault(index, _CallArray())
        calls = array.feed(text)
        return ({"tool_calls": calls} if calls else {}), _finish_reason(finish_reason, array.num_calls)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason."""
        if self._name is not None:
            calls = [self._named_call(text)]
        else:
            array = _CallArray()
            calls = [{k: v for k, v in call.items() if k != "index"} for call in array.feed(text)]
            finish_reason = _finish_reason(finish_reason, len(calls))
        return {"role": "assistant", "content": None, "tool_calls": calls}, finish_reason

    def _named_call(self, arguments: str) -> dict[str, Any]:
        return {"id": new_tool_call_id(), "type": "function", "function": {"name": self._name, "arguments": arguments}}


def _finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


class _CallArray:
    """Reads ``[{"name": ..., "parameters": {...}}, ...]`` as it streams in, yielding each call once its
    object is complete (an object, unlike a number, cannot go on after its closing brace)."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where the next item (or separator) starts
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        calls = []
        while self._pos < len(self._text):
            char = self._text[self._pos]
            if char.isspace() or char in "[,]":
                self._pos += 1
                continue
            if char != "{" or "}" not in self._text[self._pos:]:
                break  # an unfinished object (or, unconstrained, not a call at all): wait
            try:
                item, self._pos = _DECODER.raw_decode(self._text, self._pos)
            except json.JSONDecodeError:
                break
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                calls.append({"index": self.num_calls, "id": new_tool_call_id(), "type": "function",
                              "function": {"name": item["name"], "arguments": arguments}})
                self.num_calls += 1
        return calls
