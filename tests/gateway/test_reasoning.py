"""--reasoning-parser deepseek_r1: the thinking before </think> is the message's reasoning, the rest its
answer; streamed in any chunking as the whole output reads; tool calls are read from the answer only;
the Responses API gives it as a reasoning item; the tags must be tokens of the vocabulary."""

import asyncio
import random

import pytest

from services.common.pb import engine_pb2
from services.gateway.chat import ChatRenderer
from services.gateway.errors import OpenAIError
from services.gateway.generation import Step
from services.gateway.protocol import ResponsesRequest
from services.gateway.reasoning import ReasoningParser, ReasoningStream, ReasoningTags, split_reasoning
from services.gateway.responses import ResponsesRenderer
from services.gateway.serving import ChoiceResult, RequestContext, Usage
from services.gateway.structured_output import Constraint
from services.gateway.validation import GenerationParams
from tests.gateway.test_streaming import run_stream

TAGS = ReasoningTags()
OUTPUTS = {  # the model's output -> (reasoning, content), as vLLM's deepseek_r1 parser reads it
    "Let me think.\n</think>\n\nParis.": ("Let me think.\n", "\n\nParis."),
    "<think>I wrote the tag myself.</think>Yes": ("I wrote the tag myself.", "Yes"),
    "Cut off while thinking <thi": ("Cut off while thinking <thi", None),
    "</think>Straight to the answer": ("", "Straight to the answer"),
    "Thought, then nothing.</think>": ("Thought, then nothing.", None),
    "a < b and </ less </think>x </think> y": ("a < b and </ less ", "x </think> y"),
    "": ("", None),
}


@pytest.mark.parametrize("output", OUTPUTS)
def test_whole_outputs_split_as_vllm_reads_them(output):
    assert split_reasoning(output, TAGS) == OUTPUTS[output]


@pytest.mark.parametrize("output", OUTPUTS)
def test_any_chunking_streams_what_the_whole_output_says(output):
    rng = random.Random(output)
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, rng.randint(0, 6)))) if output else []
        pieces = [output[i:j] for i, j in zip([0, *cuts], [*cuts, len(output)])] if trial else list(output)
        stream, reasoning, content = ReasoningStream(TAGS), "", ""
        for piece in pieces:
            r, c = stream.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        expected_reasoning, expected_content = OUTPUTS[output]
        assert (reasoning + r, content + c) == (expected_reasoning, expected_content or ""), pieces


def test_a_tag_split_across_deltas_is_held_back_not_streamed():
    stream = ReasoningStream(TAGS)
    assert stream.feed("Hmm </th") == ("Hmm ", "")
    assert stream.feed("ink>Ans") == ("", "Ans")
    assert stream.feed("wer") == ("", "wer")


def chat_renderer(**kwargs) -> ChatRenderer:
    return ChatRenderer(None, False, reasoning=TAGS, **kwargs)


def test_the_message_carries_reasoning_under_both_names():
    choice = chat_renderer().full_choice(ChoiceResult(0, "Because.</think>Paris.", finish_reason="stop"))
    assert choice["message"] == {"role": "assistant", "reasoning": "Because.", "reasoning_content": "Because.",
                                 "content": "Paris."}
    hidden = chat_renderer(include_reasoning=False).full_choice(ChoiceResult(0, "Because.</think>Paris."))
    assert hidden["message"] == {"role": "assistant", "content": "Paris."}
    plain = ChatRenderer(None, False).full_choice(ChoiceResult(0, "Because.</think>Paris."))
    assert plain["message"]["content"] == "Because.</think>Paris." and "reasoning" not in plain["message"]


def test_tool_calls_are_read_from_the_answer_only():
    thought = 'maybe <tool_call>{"name": "no", "arguments": {}}</tool_call>?'
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    choice = chat_renderer(tool_parser="hermes").full_choice(
        ChoiceResult(0, f"{thought}</think>{call}", finish_reason="stop"))
    message = choice["message"]
    assert message["reasoning"] == thought and not message["content"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["weather"]
    assert choice["finish_reason"] == "tool_calls"


def test_a_stream_gives_reasoning_deltas_then_content_deltas():
    steps = [Step(0, "Let me", [1], completion_tokens=1), Step(0, " see</th", [2], completion_tokens=2),
             Step(0, "ink>\n\nPar", [3], completion_tokens=3), Step(0, "is.", [4], finish_reason="stop",
                                                                     completion_tokens=4)]
    events, _ = run_stream(chat_renderer(), GenerationParams(stream=True), steps, 1)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d.get("reasoning") for d in deltas[1:]] == ["Let me", " see", None, None]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nParis."
    assert not any("reasoning" in d and "content" in d and d["content"] for d in deltas[1:3])


def test_an_output_cut_off_while_thinking_flushes_what_was_held_back_as_reasoning():
    steps = [Step(0, "thinking <", [1], completion_tokens=1), Step(0, "/thi", [2], finish_reason="length",
                                                                   completion_tokens=2)]
    events, _ = run_stream(chat_renderer(), GenerationParams(stream=True), steps, 1)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "thinking </thi"
    assert not "".join(d.get("content") or "" for d in deltas)


def test_responses_give_a_reasoning_item_before_the_message():
    ctx, usage = RequestContext("resp_1", "m"), Usage([[1]], 1)
    body = ResponsesRenderer(ResponsesRequest(input="hi"), chat_renderer()).response(
        ctx, [ChoiceResult(0, "Because.</think>Paris.", finish_reason="stop")], usage)
    thought, message = body["output"]
    assert thought["type"] == "reasoning" and thought["content"] == [{"type": "reasoning_text", "text": "Because."}]
    assert message["content"][0]["text"] == "Paris."
    cut = ResponsesRenderer(ResponsesRequest(input="hi"), chat_renderer()).response(
        ctx, [ChoiceResult(0, "Because", finish_reason="length")], usage)
    assert [item["type"] for item in cut["output"]] == ["reasoning"] and cut["status"] == "incomplete"


def test_responses_stream_reasoning_text_events():
    steps = [Step(0, "Hm", [1], completion_tokens=1), Step(0, "m.</think>Yes", [2], finish_reason="stop",
                                                           completion_tokens=2)]
    renderer = ResponsesRenderer(ResponsesRequest(input="hi", stream=True), chat_renderer())
    events, _ = run_stream(renderer, GenerationParams(stream=True), steps, 1)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.reasoning_text.done", "response.output_item.done",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[8]["text"] == "Hmm." and events[8]["output_index"] == 0
    final = events[-1]["response"]["output"]
    assert final[0]["content"][0]["text"] == "Hmm." and final[1]["content"][0]["text"] == "Yes"


class _Vocabulary:
    """An upstream whose tokenizer knows some strings as single tokens."""

    def __init__(self, tokens: dict[str, int]):
        self.tokens = tokens

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [self.tokens[text]] if text in self.tokens else [1] * len(text)


def test_a_request_counts_its_thinking_and_its_constraint_starts_after_the_end_tag_token():
    parser = ReasoningParser("deepseek_r1")
    constraint = Constraint("response_format", engine_pb2.StructuredOutput(json_object=True))
    params = GenerationParams(constraint=constraint)
    asyncio.run(parser.prepare(_Vocabulary({"<think>": 7, "</think>": 8}), params))
    assert params.reasoning_end_token_id == 8
    assert params.constraint.param == "response_format" and params.constraint.proto.json_object
    assert list(params.constraint.proto.starts_after) == [8]
    assert not constraint.proto.starts_after  # the request's own constraint is left as it was


def test_usage_counts_the_tokens_before_the_end_tag_as_reasoning_tokens():
    usage = Usage([[1, 2]], 2, reasoning_end_token_id=8)
    usage.update(Step(0, "a", [5, 6], completion_tokens=2))
    usage.update(Step(1, "b", [5], completion_tokens=1))
    usage.update(Step(0, "c", [7, 8, 9, 8], completion_tokens=6))  # a second </think> is the answer's
    assert usage.as_dict()["completion_tokens_details"] == {"reasoning_tokens": 4}  # 3 of choice 0, 1 of choice 1
    assert "completion_tokens_details" not in Usage([[1]], 1).as_dict()
    body = ResponsesRenderer(ResponsesRequest(input="hi"), chat_renderer()).response(
        RequestContext("resp_1", "m"), [ChoiceResult(0, "x</think>y", finish_reason="stop")], usage)
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}


def test_a_vocabulary_without_the_tags_is_a_clear_server_error():
    with pytest.raises(OpenAIError, match="needs <think> and </think> as tokens") as raised:
        asyncio.run(ReasoningParser("deepseek_r1").end_token_ids(_Vocabulary({"<think>": 7})))
    assert raised.value.status == 500 and "</think> 8 tokens" in raised.value.message
