"""``llama3_json``: Llama 3.1 and 3.2 with a JSON tool-calling template answer a call with only JSON,
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by ``;``, the first
perhaps after ``<|python_tag|>``. An answer that starts otherwise is text, as vLLM streams it."""

import json
from typing import Any

from services.gateway.tool_parsers.base import ToolCallStream

_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonStream(ToolCallStream):
    """Undecided until the answer's first non-space text shows whether it is JSON; then each object is a
    call once it is complete. An object that is not a call, and what follows it, is text at the end."""

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._mode: str | None = None  # None: undecided; "text"; "calls"; "failed" (held as text)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        if self._mode is None:
            start = self._held.lstrip()
            if not start or _PYTHON_TAG.startswith(start):
                return "", []
            self._mode = "calls" if start.startswith(("{", _PYTHON_TAG)) else "text"
        if self._mode == "text":
            content, self._held = self._held, ""
            return content, []
        return "", self._complete_calls() if self._mode == "calls" else []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        calls = self._complete_calls() if self._mode == "calls" else []
        rest, self._held = self._held, ""
        return ("" if self.num_calls and not rest.strip(" \n\t;") else rest), calls

    def _complete_calls(self) -> list[dict[str, Any]]:
        """The calls whose JSON is complete at the head of what is held (which keeps the rest)."""
        calls = []
        while True:
            head = self._held.lstrip(" \n\t;")
            head = head.removeprefix(_PYTHON_TAG).lstrip()
            try:
                obj, end = _DECODER.raw_decode(head)
            except json.JSONDecodeError:
                return calls  # incomplete so far, or not JSON: decided at the end
            call = self._call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) \
                if isinstance(obj, dict) and ("arguments" in obj or "parameters" in obj) else None
            if call is None:
                self._mode = "failed"
                return calls
            calls.append(call)
            self._held = head[end:]
