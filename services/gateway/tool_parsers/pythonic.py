"""``pythonic``: Llama 3.2 (1B, 3B) with its pythonic tool template, and other models trained that way,
answer a call as a Python list of calls, ``[get_weather(city="Paris"), now()]``, keyword arguments of
literal values. An answer that does not start with ``[`` is text, as vLLM reads it."""

import ast
import json
from typing import Any

from services.gateway.tool_parsers.base import ToolCallStream


class PythonicStream(ToolCallStream):
    """Undecided until the answer's first non-space character; a list is read whole once it parses (at
    the latest when the choice ends); one that is not a list of calls with literal arguments is text."""

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._is_list: bool | None = None
        self._done = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._done:
            return "", []
        self._held += text
        if self._is_list is None:
            start = self._held.lstrip()
            if not start:
                return "", []
            self._is_list = start.startswith("[")
        if not self._is_list:
            content, self._held = self._held, ""
            return content, []
        if not self._held.rstrip().endswith("]"):
            return "", []
        calls = self._parse(self._held)
        if calls:
            self._held, self._done = "", True
        return "", calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self._held = self._held, ""
        if self._done:
            return "", []
        calls = self._parse(rest) if self._is_list else []
        return ("", calls) if calls else (rest, [])

    def _parse(self, text: str) -> list[dict[str, Any]]:
        """The calls of a list of ``name(keyword=literal, ...)``; [] when it is anything else."""
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return []
        if not isinstance(tree, ast.List) or not tree.elts:
            return []
        parsed = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return []
            try:
                arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            except ValueError:
                return []
            if None in arguments:  # **kwargs
                return []
            try:  # a set, bytes or a complex number is a literal but no JSON: text, as vLLM reads it
                parsed.append((node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
            except (TypeError, ValueError):
                return []
        return [self._call(name, arguments) for name, arguments in parsed]
