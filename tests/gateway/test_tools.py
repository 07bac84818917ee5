"""Tool calling in the gateway: the hermes parser on whole texts and on streams cut at every point,
the chat chunks and responses it yields (validated as the `openai` client's own types), and the
request rules (vLLM's messages for tool_choice). Forced tool choices ("required", a named function):
tests/gateway/test_structured_output_request.py."""

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.gateway.chat import ChatRenderer
from services.gateway.errors import OpenAIError
from services.gateway.generation import Step
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.serving import ChoiceResult
from services.gateway.tool_parsers import parse_tool_calls, tool_call_stream
from services.gateway.tools import validate_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')


def names_and_arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_whole_text_with_two_calls():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check.\n"
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})]
    assert [c["index"] for c in calls] == [0, 1]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", [
    "no tools here, just < and <tool but not a tag",
    "<tool_call>not json</tool_call> after",  # a body that is not a call stays text
    '<tool_call>{"arguments": {}}</tool_call>',  # no name: not a call
    'cut short <tool_call>{"name": "get_weather", "argu',  # unfinished when the choice ended
])
def test_text_that_is_not_a_call_stays_text(text):
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("text, content", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', None),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "Let me check.\n"),
])
def test_a_call_whose_end_tag_never_came_is_a_call(text, content):
    """The choice ended after the call's JSON (EOS, or the client's stop string "</tool_call>"): vLLM reads
    ``<tool_call>(.*)`` at the end as a call too."""
    assert parse_tool_calls(text)[0] == content
    assert names_and_arguments(parse_tool_calls(text)[1]) == [("get_weather", {"city": "Paris"})]


def test_only_calls_means_no_content_and_string_arguments_pass_through():
    content, calls = parse_tool_calls('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>\n')
    assert content is None and names_and_arguments(calls) == [("now", {})]


@pytest.mark.parametrize("text", [TWO_CALLS, "plain <tool_ text", 'a <tool_call>{"name": "b", "arguments": {}}',
                                  'a <tool_call>{"name": "b", "argu', 'x <tool_call>{"name": "a"}</tool_call>', "<tool_call>"])
def test_a_stream_cut_anywhere_gives_what_the_whole_text_gives(text):
    whole_content, whole_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            stream, content, calls = tool_call_stream("hermes"), "", []
            for piece in pieces:
                delta, new_calls = stream.feed(piece)
                content, calls = content + delta, calls + new_calls
            rest, last = stream.finish()
            content, calls = content + rest, calls + last
            assert (content or None if calls else content) == whole_content, (cut, pieces)
            assert names_and_arguments(calls) == names_and_arguments(whole_calls)


def test_streamed_chunks_and_response_are_what_the_openai_client_reads():
    renderer = ChatRenderer(upstream=None, with_logprobs=False, tool_parser="hermes")
    pieces = ["Let me", " check.\n<tool", '_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
              "\n</tool_call>", ""]
    chunks = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        choice = renderer.stream_choice(Step(index=0, text=piece, finish_reason="stop" if last else None))
        if choice is not None:
            chunks.append(ChatCompletionChunk.model_validate(
                {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check.\n"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    full = renderer.full_choice(ChoiceResult(index=0, text=TWO_CALLS, finish_reason="stop"))
    response = ChatCompletion.model_validate({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                              "choices": [full]})
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.content == "Let me check.\n"
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_weather"]


def test_a_choice_cut_by_length_keeps_its_finish_reason():
    renderer = ChatRenderer(upstream=None, with_logprobs=False, tool_parser="hermes")
    full = renderer.full_choice(ChoiceResult(index=0, text=TWO_CALLS, finish_reason="length"))
    assert full["finish_reason"] == "length" and len(full["message"]["tool_calls"]) == 2


def tool_use(parser="hermes", **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return validate_tools(ChatCompletionRequest(**body), parser)


@pytest.mark.parametrize("fields, parser, message", [
    ({"tool_choice": "auto"}, "hermes", "When using `tool_choice`, `tools` must be set."),
    ({"tools": [WEATHER]}, None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, None, '"auto" tool choice requires'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "hermes",
     "Tool 'get_time' has not been passed in `tools`"),
    ({"tools": [{"type": "function", "function": {}}]}, "hermes", "Each tool must be"),
    ({"tools": [{"type": "retrieval"}]}, "hermes", "Each tool must be"),
])
def test_tool_rules_give_400(fields, parser, message):
    with pytest.raises(OpenAIError) as info:
        tool_use(parser, **fields)
    assert info.value.status == 400 and message in info.value.message
    assert info.value.param in ("tool_choice", "tools.[0]")


def test_tool_use_when_allowed():
    auto = tool_use(tools=[WEATHER])  # no tool_choice with tools: "auto"
    assert auto.tools == [WEATHER] and auto.parser == "hermes"
    none = tool_use(None, tools=[WEATHER], tool_choice="none")  # the template still sees the tools
    assert none.tools == [WEATHER] and none.parser is None
    assert tool_use(None) == tool_use("hermes") and tool_use(None).parser is None


def test_without_parallel_tool_calls_a_choice_keeps_its_first_call():
    """As vLLM (its #26233): parallel_tool_calls false drops the calls after the first, streamed or not."""
    renderer = ChatRenderer(upstream=None, with_logprobs=False, tool_parser="hermes", parallel_tool_calls=False)
    full = renderer.full_choice(ChoiceResult(index=0, text=TWO_CALLS, finish_reason="stop"))
    assert names_and_arguments(full["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    assert full["finish_reason"] == "tool_calls"
    streamed = ChatRenderer(upstream=None, with_logprobs=False, tool_parser="hermes", parallel_tool_calls=False)
    choices = [streamed.stream_choice(Step(index=0, text=piece, finish_reason=finish))
               for piece, finish in ((TWO_CALLS[:90], None), (TWO_CALLS[90:], "stop"))]
    calls = [call for choice in choices if choice for call in choice["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert choices[-1]["finish_reason"] == "tool_calls"
