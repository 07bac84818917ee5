"""SSE framing as OpenAI/vLLM send it."""

import json

import pytest

from services.gateway import sse
from services.gateway.errors import OpenAIError


def test_event_is_one_data_line_and_a_blank_line():
    raw = sse.event({"text": "a\nb", "emoji": "😀"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 2  # newlines inside the payload are JSON-escaped
    assert json.loads(raw[len(b"data: "):]) == {"text": "a\nb", "emoji": "😀"}


def test_done_marker():
    assert sse.DONE == b"data: [DONE]\n\n"


def test_error_after_start_is_an_error_event_then_done():
    events = sse.error_events(OpenAIError("boom", 503))
    assert sse.parse(b"".join(events)) == [
        {"error": {"message": "boom", "type": "service_unavailable_error", "param": None, "code": None}},
        "[DONE]"]


def test_parse_round_trip():
    body = sse.event({"a": 1}) + sse.event({"b": [2]}) + sse.DONE
    assert sse.parse(body) == [{"a": 1}, {"b": [2]}, "[DONE]"]


def test_chunk_framing_writes_the_bytes_of_the_whole_chunk_encoded():
    fixed = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m\"odel 😀"}
    choices = [{"index": 0, "text": "a\nb", "logprobs": None, "finish_reason": None}]
    framing = sse.ChunkFraming(fixed)
    assert framing.event(choices) == sse.event({**fixed, "choices": choices})
    assert framing.event(choices, None) == sse.event({**fixed, "choices": choices, "usage": None})
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert framing.event([], usage) == sse.event({**fixed, "choices": [], "usage": usage})


def test_events_are_json_dumps_bytes_with_or_without_the_c_encoder(monkeypatch):
    payloads = [{"text": "é\u2028\"\\\n", "n": [1, -2.5e-07, None, True, False], "nested": {"k": [{}]}},
                {"inf": float("inf")}, {"big": 10 ** 30}]  # (what json.dumps writes, valid JSON or not)
    expected = [b"data: " + json.dumps(p, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
                for p in payloads]
    assert sse._C_ENCODER is not None  # (CPython's accelerator)
    for c_encoder in (True, False):
        if not c_encoder:
            monkeypatch.setattr(sse, "_encode", sse._ENCODER.encode)
        assert [sse.event(p) for p in payloads] == expected
        with pytest.raises(TypeError, match="not JSON serializable"):
            sse.event({"x": object()})
