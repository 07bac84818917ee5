"""The llama3_json, mistral and pythonic tool-call parsers (hermes: test_tools.py): whole answers read as vLLM's
parsers read them, any cut of a stream reads as the whole answer does, Mistral's ids and special tokens."""

import json

import pytest

from services.gateway.protocol import ChatCompletionRequest
from services.gateway.tool_parsers import parse_tool_calls, tool_call_stream
from services.gateway.tools import validate_tools

PARIS = {"city": "Paris"}


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


LLAMA3 = {  # answer -> (content, calls)
    '{"name": "get_weather", "parameters": {"city": "Paris"}}': (None, [("get_weather", PARIS)]),
    '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}': (None, [("get_weather", PARIS)]),
    ' {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, {"y": "}"}]}}':
        (None, [("a", {}), ("b", {"x": [1, {"y": "}"}]})]),
    "It is sunny in Paris.": ("It is sunny in Paris.", []),
    'Use {"name": "x", "parameters": {}} like this': ('Use {"name": "x", "parameters": {}} like this', []),
    '{"city": "Paris"}': ('{"city": "Paris"}', []),  # an object that is not a call
    '{"name": "get_weather", "parameters": {"city": "Par': ('{"name": "get_weather", "parameters": {"city": "Par', []),
}
MISTRAL = {
    'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]':
        ("Sure.", [("get_weather", PARIS), ("now", {})]),
    '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}': (None, [("get_weather", PARIS), ("now", {})]),
    # v13 tokenizers (Mistral Small 3.2, Magistral, Devstral) put [ARGS] between name and arguments; vLLM drops it
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}':
        ("Sure.", [("get_weather", PARIS), ("now", {})]),
    "No call [TOOL_CALL here.": ("No call [TOOL_CALL here.", []),
    "[TOOL_CALLS] [not json at all": ("[not json at all", []),
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}] junk]':
        (None, [("get_weather", PARIS)]),
}
PYTHONIC = {
    '[get_weather(city="Paris"), now()]': (None, [("get_weather", PARIS), ("now", {})]),
    ' [f(x=[1, {"y": "]"}], z=None, w=True)]': (None, [("f", {"x": [1, {"y": "]"}], "z": None, "w": True})]),
    "Sunny in Paris.": ("Sunny in Paris.", []),
    "[1, 2, 3]": ("[1, 2, 3]", []),  # a list, not of calls
    '[f(open("x"))]': ('[f(open("x"))]', []),  # a positional, non-literal argument
    '[get_weather(city="Par': ('[get_weather(city="Par', []),  # cut off
    # literals that are no JSON (a set, bytes, a complex number, infinity): text, as vLLM gives them, not a 500
    "[f(x={1, 2})]": ("[f(x={1, 2})]", []),
    '[f(x=b"ab")]': ('[f(x=b"ab")]', []),
    "[f(x=1j)]": ("[f(x=1j)]", []),
    "[f(x=1e999)]": ("[f(x=1e999)]", []),
}
CASES = [("llama3_json", text, expected) for text, expected in LLAMA3.items()] + \
        [("mistral", text, expected) for text, expected in MISTRAL.items()] + \
        [("pythonic", text, expected) for text, expected in PYTHONIC.items()]


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_whole_answers(parser, text, expected):
    content, calls = parse_tool_calls(text, parser)
    assert (content, calls_of(calls)) == expected
    assert [c["index"] for c in calls] == list(range(len(calls)))


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_a_stream_cut_anywhere_reads_as_the_whole_answer(parser, text, expected):
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            stream, content, calls = tool_call_stream(parser), "", []
            for piece in pieces:
                delta, new_calls = stream.feed(piece)
                content, calls = content + delta, calls + new_calls
            rest, last = stream.finish()
            content, calls = content + rest, calls + last
            assert (content or None if calls else content, calls_of(calls)) == expected, pieces
            assert stream.num_calls == len(calls)


def test_llama3_calls_stream_as_each_object_completes():
    stream = tool_call_stream("llama3_json")
    content, calls = stream.feed('{"name": "a", "parameters": {}}; {"name": "b", ')
    assert content == "" and calls_of(calls) == [("a", {})]
    content, calls = stream.feed('"parameters": {"k": 1}}')
    assert content == "" and calls_of(calls) == [("b", {"k": 1})]


def test_mistral_ids_are_nine_letters_or_digits_and_its_markers_are_kept():
    _, calls = parse_tool_calls('[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]',
                                "mistral")
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls) and calls[0]["id"] != calls[1]["id"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "a"}}]}
    assert validate_tools(ChatCompletionRequest(**body), "mistral").keeps_special_tokens
    assert not validate_tools(ChatCompletionRequest(**body), "hermes").keeps_special_tokens
    assert not validate_tools(ChatCompletionRequest(**body, tool_choice="none"), "mistral").keeps_special_tokens
