import json

import pytest

from services.bench.http_stream import EventSplitter
from services.bench.sse import TokenTimeline


def test_splitter_events_comments_multiline_crlf_across_chunks():
    body = b'data: {"a":1}\n\n: ping\n\nevent: message\ndata: line1\ndata:line2\n\ndata: [DONE]\r\n\r\n'
    for cut in range(len(body) + 1):  # every place a chunk may end, a CRLF's halves in two chunks too
        splitter = EventSplitter()
        events = splitter.feed(body[:cut]) + splitter.feed(body[cut:]) + splitter.flush()
        assert [e for e in events if e is not None] == ['{"a":1}', "line1\nline2", "[DONE]"], cut


def test_splitter_flush_returns_unterminated_event():
    splitter = EventSplitter()
    assert splitter.feed(b"data: tail") == []
    assert splitter.flush() == ["tail"]
    assert splitter.flush() == []


def completion(text, usage=None, logprob_tokens=None):
    choice = {"index": 0, "text": text, "finish_reason": None}
    if logprob_tokens is not None:
        choice["logprobs"] = {"tokens": logprob_tokens}
    data = {"choices": [choice]}
    if usage is not None:
        data["usage"] = {"prompt_tokens": 3, "completion_tokens": usage}
    return json.dumps(data)


def usage_only(completion_tokens):
    return json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}})


def test_continuous_usage_attributes_each_token_of_a_chunk():
    tl = TokenTimeline(start=0.0)
    assert tl.on_data(completion("a", usage=1), 1.0)
    assert tl.on_data(completion("bcd", usage=4), 2.5)  # 3 tokens after a 1.5 s gap
    assert tl.on_data(completion("", usage=4), 2.6)  # finish chunk: no new token
    assert tl.on_data(usage_only(4), 2.7)
    assert not tl.on_data("[DONE]", 2.8)
    assert tl.ttft == 1.0
    assert tl.itl == [0.5, 0.5, 0.5]
    assert (tl.output_tokens, tl.prompt_tokens, tl.num_counted) == (4, 3, 4)


def test_logprobs_count_tokens_per_chunk():
    tl = TokenTimeline(start=0.0)
    tl.on_data(completion("ab", logprob_tokens=["a", "b"]), 0.2)
    tl.on_data(completion("cd", logprob_tokens=["c", "d"]), 0.6)
    assert tl.ttft == 0.2
    assert tl.itl == pytest.approx([0.0, 0.2, 0.2])
    assert tl.output_tokens == 4


def test_without_token_counts_each_chunk_that_shows_a_token_is_one_and_usage_sets_the_total():
    tl = TokenTimeline(start=0.0)
    tl.on_data(completion("a"), 1.0)
    tl.on_data(completion(""), 2.0)  # empty text before the finish: a token that shows nothing yet
    tl.on_data(completion("bc"), 3.0)
    tl.on_data(json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}), 3.05)  # no token
    tl.on_data(usage_only(5), 3.1)
    assert tl.itl == [1.0, 1.0]
    assert tl.num_counted == 3
    assert tl.output_tokens == 5  # the server's count wins


def test_a_stream_whose_only_token_shows_no_text_is_timed_at_its_finishing_chunk():
    for finishing in ({"index": 0, "text": "", "finish_reason": "stop"},
                      {"index": 0, "delta": {}, "finish_reason": "stop"}):
        tl = TokenTimeline(start=0.0)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        tl.on_data(json.dumps(role), 0.1)
        tl.on_data(json.dumps({"choices": [finishing]}), 0.5)
        tl.on_data(usage_only(1), 0.6)
        assert tl.ttft == 0.5 and tl.output_tokens == 1


def test_chat_role_chunk_is_not_the_first_token():
    tl = TokenTimeline(start=0.0)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tl.on_data(json.dumps(role), 0.5)
    assert tl.ttft is None
    tl.on_data(json.dumps({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}), 0.8)
    tl.on_data(json.dumps({"choices": [{"index": 0, "delta": {"content": "!"}}]}), 1.0)
    assert tl.ttft == 0.8
    assert tl.itl == pytest.approx([0.2])
    assert tl.output_tokens == 2


def test_error_event_and_bad_json_stop_the_stream():
    tl = TokenTimeline(start=0.0)
    assert not tl.on_data(json.dumps({"error": {"message": "engine died", "code": 500}}), 0.1)
    assert tl.error == "engine died"
    tl = TokenTimeline(start=0.0)
    assert not tl.on_data("{not json", 0.1)
    assert tl.error.startswith("bad SSE data")


def test_extra_tokens_in_the_first_chunk_are_zero_gaps():
    tl = TokenTimeline(start=0.0)
    tl.on_data(completion("ab", usage=2), 0.4)  # the first token's text was held back a step
    tl.on_data(completion("c", usage=3), 0.5)
    assert tl.ttft == 0.4
    assert tl.itl == pytest.approx([0.0, 0.1])
    assert len(tl.itl) == tl.output_tokens - 1


def test_cached_tokens_come_from_the_usage_details():
    def usage_with(details):
        usage = {"prompt_tokens": 3, "completion_tokens": 1}
        if details is not ...:
            usage["prompt_tokens_details"] = details
        return json.dumps({"choices": [], "usage": usage})

    for details, cached in (({"cached_tokens": 2}, 2), (None, None), (..., None), ({}, None)):
        timeline = TokenTimeline(start=0.0)
        assert timeline.on_data(completion("a"), 0.5)
        assert timeline.on_data(usage_with(details), 1.0)
        assert timeline.cached_tokens == cached, details
