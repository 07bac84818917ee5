"""``/v1/responses``: the request read as the chat request it means (messages, function calls and their
outputs, function tools), and the answer in the Responses shapes: a message item of one output_text
part, a function_call item per call, OpenAI's stream events with their sequence numbers (no [DONE]),
``incomplete`` when max_output_tokens cut it, an error after the stream began as an ``error`` event and
``response.failed``."""

import pytest

from services.gateway.chat import ChatRenderer
from services.gateway.errors import OpenAIError
from services.gateway.forced_tool_calls import ForcedToolCalls
from services.gateway.generation import Step
from services.gateway.protocol import ResponsesRequest
from services.gateway.responses import ResponsesRenderer, chat_request
from services.gateway.serving import ChoiceResult, RequestContext, Usage
from services.gateway.validation import GenerationParams
from tests.gateway.test_streaming import run_stream


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def stream_renderer() -> ResponsesRenderer:
    return ResponsesRenderer(request(stream=True), ChatRenderer(None, False))


def test_input_and_instructions_become_the_chat_messages():
    chat = chat_request(request(instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
        {"role": "user", "content": "Encore"}], max_output_tokens=7, temperature=0.5, top_p=0.9))
    assert [(m.role, m.content if isinstance(m.content, str) else [p.text for p in m.content])
            for m in chat.messages] == [("system", "Be brief."), ("system", "Answer in French."), ("user", ["Bonjour"]),
                                        ("assistant", ["Salut"]), ("user", "Encore")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)
    assert [(m.role, m.content) for m in chat_request(request()).messages] == [("user", "Hi")]


def test_function_calls_and_their_outputs_become_the_chat_turns():
    chat = chat_request(request(input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]}],
        tools=[{"type": "function", "name": "weather", "description": "d", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "weather"}))
    user, assistant, first, second = chat.messages
    assert [(call.id, call.function.name, call.function.arguments) for call in assistant.tool_calls] == [
        ("c1", "weather", '{"city": "Paris"}'), ("c2", "weather", '{"city": "Rome"}')]
    assert (first.role, first.tool_call_id, first.content) == ("tool", "c1", "sunny")
    assert (second.tool_call_id, [part.text for part in second.content]) == ("c2", ["rain"])
    assert chat.tools == [{"type": "function", "function": {"name": "weather", "description": "d",
                                                            "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "weather"}}


def test_text_format_becomes_the_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_request(request(text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}))
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == schema and chat.response_format.json_schema.name == "a"
    assert chat_request(request(text={"format": {"type": "json_object"}})).response_format.type == "json_object"
    assert chat_request(request(text={"format": {"type": "text"}})).response_format is None


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content"),
])
def test_what_is_not_served_is_a_400_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as refused:
        chat_request(request(**fields))
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_response_holds_one_message_of_one_output_text():
    ctx = RequestContext("resp_1", "m")
    usage = Usage([[1, 2, 3]], 1)
    usage.update(Step(0, "", [7, 8], completion_tokens=2, cached_tokens=2))
    body = ResponsesRenderer(request(instructions="x"), ChatRenderer(None, False)).response(
        ctx, [ChoiceResult(0, "Hello", finish_reason="stop")], usage)
    assert (body["object"], body["status"], body["incomplete_details"], body["instructions"]) == ("response", "completed",
                                                                                                  None, "x")
    [message] = body["output"]
    assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
    assert message["content"] == [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}
    cut = ResponsesRenderer(request(), ChatRenderer(None, False)).response(
        ctx, [ChoiceResult(0, "Hel", finish_reason="length")], usage)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def test_the_stream_is_openais_events_in_order():
    steps = [Step(0, "Hel", [1], completion_tokens=1), Step(0, "", [2], completion_tokens=2),
             Step(0, "lo", [3], finish_reason="length", completion_tokens=3)]
    events, _ = run_stream(stream_renderer(), GenerationParams(stream=True), steps, 1)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 3
    assert events[2]["item"]["id"] == events[4]["item_id"] == final["output"][0]["id"]


def test_a_failure_after_the_stream_began_is_an_error_event_then_response_failed():
    steps = [Step(0, "partial", [1]), OpenAIError("engine failed: UNAVAILABLE", 503)]
    events, _ = run_stream(stream_renderer(), GenerationParams(stream=True), steps, 1)
    assert events[4]["delta"] == "partial"
    assert events[5]["type"] == "error" and events[5]["message"] == "engine failed: UNAVAILABLE"
    assert events[6]["type"] == "response.failed" and events[6]["response"]["status"] == "failed"
    assert len(events) == 7  # no [DONE]: the Responses stream ends with its last event


def test_a_forced_call_is_a_function_call_item():
    ctx, usage = RequestContext("resp_1", "m"), Usage([[1]], 1)
    body = ResponsesRenderer(request(), ChatRenderer(None, False, forced_tool_calls=ForcedToolCalls("weather"))).response(
        ctx, [ChoiceResult(0, '{"city": "Paris"}', finish_reason="stop")], usage)
    [call] = body["output"]
    assert (call["type"], call["name"], call["arguments"], call["status"]) == (
        "function_call", "weather", '{"city": "Paris"}', "completed")
    assert call["call_id"] and body["status"] == "completed"


def test_a_streamed_call_opens_its_item_and_streams_its_arguments():
    steps = [Step(0, '{"city": ', [1], completion_tokens=1), Step(0, '"Paris"}', [2], finish_reason="stop",
                                                                   completion_tokens=2)]
    renderer = ResponsesRenderer(request(stream=True), ChatRenderer(None, False, forced_tool_calls=ForcedToolCalls("weather")))
    events, _ = run_stream(renderer, GenerationParams(stream=True), steps, 1)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2]["item"]["name"] == "weather" and events[2]["item"]["type"] == "function_call"
    assert events[5]["arguments"] == '{"city": "Paris"}'
    assert events[-1]["response"]["output"] == [events[6]["item"]] and events[6]["item"]["status"] == "completed"
