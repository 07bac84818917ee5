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

The parsers, one per model format, are ``tool_parsers/``.
"""

import json
from dataclasses import dataclass
from typing import Any

from services.gateway import errors
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.structured_output import Constraint, json_schema
from services.gateway.tool_parsers import PARSERS


@dataclass(frozen=True)
class ForcedToolChoice:
    """A tool_choice that forces a call: ``function_name`` for a named function, None for "required"."""
    function_name: str | None
    constraint: Constraint


@dataclass(frozen=True)
class ToolUse:
    """What one chat request does with tools."""
    tools: list[dict[str, Any]] | None  # for the chat template
    parser: str | None  # the parser that reads tool calls out of the generated text; None: none are read
    forced: ForcedToolChoice | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser's markers are special tokens: the answer is decoded with them (as vLLM does)."""
        return self.parser is not None and PARSERS[self.parser].needs_special_tokens


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
        return ToolUse(req.tools, parser=None)
    if choice == "auto":
        if tool_call_parser is None:
            raise errors.bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                     '--tool-call-parser to be set', param="tool_choice")
        return ToolUse(req.tools, parser=tool_call_parser)
    if choice == "required":
        schema = _required_schema(req.tools, max_calls=1 if req.parallel_tool_calls is False else None)
        return ToolUse(req.tools, None, ForcedToolChoice(None, json_schema(schema, "tool_choice")))
    name = _named_function(choice)
    functions = {tool["function"]["name"]: tool["function"] for tool in req.tools}
    if name not in functions:
        raise errors.bad_request(f"Tool '{name}' has not been passed in `tools`; tool_choice names one of: "
                                 f"{', '.join(functions)}.", param="tool_choice")
    schema = _parameters(functions[name])
    return ToolUse(req.tools, None, ForcedToolChoice(name, json_schema(schema, "tool_choice")))


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
