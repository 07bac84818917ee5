"""Reading tool calls out of a model's text: ``--tool-call-parser`` names the model's format (vLLM's
names), ``--enable-auto-tool-choice`` turns it on.

  hermes       Hermes 2 Pro, Qwen2.5, Qwen3: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks.
  llama3_json  Llama 3.1, 3.2 with a JSON tool template: an answer of ``{"name", "parameters"}`` objects.
  mistral      Mistral 7B Instruct v0.3 and later: ``[TOOL_CALLS]`` and a JSON array of calls.
  pythonic     Llama 3.2 1B/3B with a pythonic template: ``[name(keyword=value, ...), ...]``.
"""

from typing import Any

from services.gateway.tool_parsers.base import ToolCallStream, new_tool_call_id, parse_whole
from services.gateway.tool_parsers.hermes import HermesStream
from services.gateway.tool_parsers.llama3_json import Llama3JsonStream
from services.gateway.tool_parsers.mistral import MistralStream
from services.gateway.tool_parsers.pythonic import PythonicStream

PARSERS: dict[str, type[ToolCallStream]] = {"hermes": HermesStream, "llama3_json": Llama3JsonStream,
                                            "mistral": MistralStream, "pythonic": PythonicStream}
TOOL_CALL_PARSERS = tuple(PARSERS)

__all__ = ["PARSERS", "TOOL_CALL_PARSERS", "ToolCallStream", "new_tool_call_id", "parse_tool_calls",
           "tool_call_stream"]


def tool_call_stream(parser: str) -> ToolCallStream:
    return PARSERS[parser]()


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """A finished choice's text → (content, tool calls); content None when only whitespace surrounds the calls."""
    return parse_whole(tool_call_stream(parser), text)
