"""``hermes``: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, with text around them."""

import json
from typing import Any

from services.gateway.held_back import held_back_length
from services.gateway.tool_parsers.base import ToolCallStream

_START, _END = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    """A tagged body that is not a call (not JSON, no name) stays text, tags and all; whitespace after the
    first call is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        content, calls = [], []
        while True:
            if not self._in_call:
                start = self._held.find(_START)
                if start < 0:
                    cut = len(self._held) - held_back_length(self._held, (_START,))
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
                call = self._parse(body)
                if call is None:
                    content.append(_START + body + _END)
                else:
                    calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is still held: a call whose ``</tool_call>`` never came (the choice ended, say at a stop
        string ``</tool_call>``) is a call where its body is one, as vLLM's parser reads
        ``<tool_call>(.*)`` at the end; else (a partial tag, a cut-off call) text."""
        call = self._parse(self._held) if self._in_call else None
        rest = "" if call is not None else (_START if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return self._text(rest), [call] if call is not None else []

    def _text(self, text: str) -> str:
        return "" if self.num_calls and not text.strip() else text

    def _parse(self, body: str) -> dict[str, Any] | None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict):
            return None
        return self._call(call.get("name"), call.get("arguments", {}))
