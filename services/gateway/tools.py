"""Tool calling (OpenAI ``tools`` / ``tool_choice``), served as vLLM serves it.

The tools reach the chat template as ``tools``, the way transformers passes them; an assistant turn's
``tool_calls`` and a tool turn's ``tool_call_id`` reach it too. Reading calls back out of the model's
text needs a parser for the model's format: ``--tool-call-parser`` names it and
``--enable-auto-tool-choice`` turns it on, as in vLLM, and ``tool_choice: "auto"`` (the default when
tools are given) needs both.

``"required"`` and a named function force a call with structured output instead, as vLLM does, and need
no parser: "required" constrains the output to a JSON array of at least one ``{"name", "parameters"}``
object, each one of the tools with its parameters schema; a named function constrains the output to
that function's parameters schema, the output being its arguments. ``forced_tool_calls.py`` reads the
output back as tool calls.

Parsers:
  hermes  Hermes 2 Pro, Qwen2.5, Qwen3: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

import json
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway import errors
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.structured_output import Constraint, json_schema

TOOL_CALL_PARSERS = ("hermes",)
_START, _END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ForcedToolChoice:
    """A tool_choice that forces a call: ``function_name`` for a named function, None for "required"."""
    function_name: str | None
    constraint: Constraint


@dataclass(frozen=True)
class ToolUse:
    """What one chat request does with tools."""
    tools: list[dict[str, Any]] | None  # for the chat template
    parses_calls: bool  # read tool calls out of the generated text
    forced: ForcedToolChoice | None = None


def check_tool_definitions(tools: list[dict[str, Any]] | None) -> None:
    """400 unless each tool is ``{"type": "function", "function": {"name": ..., "parameters": {...}}}``."""
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise errors.bad_request('Each tool must be {"type": "function", "function": {"name": ..., ...}}.',
                                     param=f"tools.[{i}]")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise errors.bad_request("A tool's parameters must be a JSON schema (a JSON object).",
                                     param=f"tools.[{i}].function.parameters")


def validate_tools(req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolUse:
    """``tool_call_parser``: the server's parser when auto tool choice is on, else None."""
    if req.tool_choice is not None and not req.tools:
        raise errors.bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    check_tool_definitions(req.tools)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice == "none":
        return ToolUse(req.tools, parses_calls=False)
    if choice == "auto":
        if tool_call_parser is None:
            raise errors.bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                     '--tool-call-parser to be set', param="tool_choice")
        return ToolUse(req.tools, parses_calls=True)
    if choice == "required":
        schema = _required_schema(req.tools, max_calls=1 if req.parallel_tool_calls is False else None)
        return ToolUse(req.tools, False, ForcedToolChoice(None, json_schema(schema, "tool_choice")))
    name = _named_function(choice)
    functions = {tool["function"]["name"]: tool["function"] for tool in req.tools}
    if name not in functions:
        raise errors.bad_request(f"Tool '{name}' has not been passed in `tools`; tool_choice names one of: "
                                 f"{', '.join(functions)}.", param="tool_choice")
    schema = _parameters(functions[name])
    return ToolUse(req.tools, False, ForcedToolChoice(name, json_schema(schema, "tool_choice")))


def _named_function(choice: str | dict[str, Any]) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function" or not isinstance(function.get("name"), str):
        raise errors.bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                 f'"function": {{"name": ...}}}}, got {json.dumps(choice)[:200]}.', param="tool_choice")
    return function["name"]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _required_schema(tools: list[dict[str, Any]], max_calls: int | None) -> dict[str, Any]:
    """vLLM's schema for "required": an array of one or more calls, each ``{"name", "parameters"}`` of one
    tool. A tool's ``$defs`` move to the root, where its ``#/$defs/...`` references point."""
    defs: dict[str, dict[str, Any]] = {}
    calls = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(_parameters(function))
        for key in ("$defs", "definitions"):
            for def_name, definition in (parameters.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise errors.bad_request(f"Tools define {key}.{def_name} differently; with tool_choice "
                                             '"required" their definitions share one namespace.', param="tools")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return {**schema, **{key: value for key, value in defs.items() if value}}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


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
    return {"index": index, "id": new_tool_call_id(), "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}
