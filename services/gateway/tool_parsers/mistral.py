"""``mistral``: Mistral 7B Instruct v0.3 and its kin write ``[TOOL_CALLS]`` (a special token, so the
choice is decoded with special tokens kept) and then a JSON array of ``{"name", "arguments"}``; models
of Mistral's v11 tokenizer write ``[TOOL_CALLS]name{arguments}`` per call (v13's, as Mistral Small 3.2's,
``[TOOL_CALLS]name[ARGS]{arguments}``). Text before the first ``[TOOL_CALLS]`` is content. Call ids are
9 letters and digits, which Mistral's chat templates require of the ids sent back."""

import json
import random
import re
import string
from typing import Any

from services.gateway.held_back import held_back_length
from services.gateway.tool_parsers.base import ToolCallStream

_TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_ARRAY = re.compile(r"\[\{.*\}\]", re.DOTALL)
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralStream(ToolCallStream):
    """The calls after ``[TOOL_CALLS]`` are read once the choice ends (or the array is complete; what
    follows a complete array is dropped, as vLLM drops it); text after the marker that holds no call
    comes back as content."""

    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._in_calls = False
        self._array_done = False

    def new_id(self) -> str:
        return "".join(random.choices(_ID_CHARACTERS, k=9))

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._array_done:
            return "", []
        self._held += text
        if not self._in_calls:
            start = self._held.find(_TOOL_CALLS)
            if start < 0:
                cut = len(self._held) - held_back_length(self._held, (_TOOL_CALLS,))
                content, self._held = self._held[:cut], self._held[cut:]
                return content, []
            content, self._held, self._in_calls = self._held[:start], self._held[start:], True
            return content, self._complete_array()
        return "", self._complete_array()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self._held = self._held, ""
        if not self._in_calls or not rest.strip():
            return rest, []
        calls = self._parse(rest)
        return ("", calls) if calls else (rest.replace(_TOOL_CALLS, "", 1).strip(), [])

    def _complete_array(self) -> list[dict[str, Any]]:
        """The calls of a pre-v11 array as soon as it parses whole."""
        body = self._held.removeprefix(_TOOL_CALLS).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return []
        try:
            entries = json.loads(body)
        except json.JSONDecodeError:
            return []
        calls = self._calls(entries)
        if calls:
            self._held, self._array_done = "", True
        return calls

    def _parse(self, text: str) -> list[dict[str, Any]]:
        pieces = text.split(_TOOL_CALLS)[1:]
        if len(pieces) == 1 and pieces[0].strip().startswith("["):  # pre-v11: one array
            body = pieces[0].strip()
            for candidate in (body, *_ARRAY.findall(body)[:1]):
                try:
                    return self._calls(json.loads(candidate))
                except json.JSONDecodeError:
                    continue
            return []
        calls = []  # v11: name{arguments} after each marker; v13: name[ARGS]{arguments}
        for piece in pieces:
            brace = piece.find("{")
            name = piece[:brace].replace(_ARGS, "").strip()  # as vLLM drops it
            call = self._call(name, piece[brace:].strip()) if brace > 0 else None
            if call is not None:
                calls.append(call)
        return calls

    def _calls(self, entries: Any) -> list[dict[str, Any]]:
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e for e in entries):
            return []
        calls = [self._call(e["name"], e.get("arguments", {})) for e in entries]
        return calls if all(calls) else []
