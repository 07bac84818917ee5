"""What every tool-call parser is: a stream over one choice's text that splits it into content and
finished tool calls, each call sent whole (OpenAI's ``tool_calls`` entry with its ``index``)."""

import json
import uuid
from typing import Any


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallStream:
    """``feed(text)`` and, when the choice ends, ``finish()`` return (content, calls): the text that is
    not a call, and the calls finished by it. Text that may still turn out to be part of a call is held
    until it is decided. ``num_calls`` counts the calls so far."""

    needs_special_tokens = False  # the format's markers are special tokens: decode must keep them

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError

    def new_id(self) -> str:
        return new_tool_call_id()

    def _call(self, name: Any, arguments: Any) -> dict[str, Any] | None:
        """A call of ``name`` with ``arguments`` (a JSON value, or its text), numbered; None if no name."""
        if not isinstance(name, str) or not name:
            return None
        call = {"index": self.num_calls, "id": self.new_id(), "type": "function",
                "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                             else json.dumps(arguments, ensure_ascii=False)}}
        self.num_calls += 1
        return call


def parse_whole(stream: ToolCallStream, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished choice's text → (content, tool calls), as its stream reads it. Content is None when
    only whitespace surrounds the calls."""
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    return (None if calls and not content.strip() else content), calls
