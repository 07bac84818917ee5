"""``/v1/responses``: the request read as the chat request it means, and the answer in the Responses
shapes: one message item of one output_text part, OpenAI's stream events with their sequence numbers
(no [DONE]), ``incomplete`` when max_output_tokens cut it, an error after the stream began as an
``error`` event and ``response.failed``."""

import pytest

from services.gateway.errors import OpenAIError
from services.gateway.generation import Step
from services.gateway.protocol import ResponsesRequest
from services.gateway.responses import ResponsesRenderer, chat_request
from services.gateway.serving import ChoiceResult, RequestContext, Usage
from services.gateway.validation import GenerationParams
from tests.gateway.test_streaming import run_stream


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


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


def test_text_format_becomes_the_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_request(request(text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}))
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == schema and chat.response_format.json_schema.name == "a"
    assert chat_request(request(text={"format": {"type": "json_object"}})).response_format.type == "json_object"
    assert chat_request(request(text={"format": {"type": "text"}})).response_format is None


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]"),
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
    body = ResponsesRenderer(request(instructions="x")).response(ctx, [ChoiceResult(0, "Hello", finish_reason="stop")], usage)
    assert (body["object"], body["status"], body["incomplete_details"], body["instructions"]) == ("response", "completed",
                                                                                                  None, "x")
    [message] = body["output"]
    assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
    assert message["content"] == [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}
    cut = ResponsesRenderer(request()).response(ctx, [ChoiceResult(0, "Hel", finish_reason="length")], usage)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def test_the_stream_is_openais_events_in_order():
    steps = [Step(0, "Hel", [1], completion_tokens=1), Step(0, "", [2], completion_tokens=2),
             Step(0, "lo", [3], finish_reason="length", completion_tokens=3)]
    events, source = run_stream(ResponsesRenderer(request(stream=True)), GenerationParams(stream=True), steps, 1)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 3
    assert events[2]["item"]["id"] == events[4]["item_id"] == final["output"][0]["id"]
    assert source.cancelled


def test_a_failure_after_the_stream_began_is_an_error_event_then_response_failed():
    steps = [Step(0, "partial", [1]), OpenAIError("engine failed: UNAVAILABLE", 503)]
    events, source = run_stream(ResponsesRenderer(request(stream=True)), GenerationParams(stream=True), steps, 1)
    assert events[4]["delta"] == "partial"
    assert events[5]["type"] == "error" and events[5]["message"] == "engine failed: UNAVAILABLE"
    assert events[6]["type"] == "response.failed" and events[6]["response"]["status"] == "failed"
    assert len(events) == 7 and source.cancelled  # no [DONE]: the Responses stream ends with its last event
