"""Structured output in the gateway (issue #13): every request field that constrains the output
(`response_format`, vLLM's `structured_outputs` and `guided_*`, a forced `tool_choice`) becomes the
engine's `StructuredOutput` on every Generate call of the request; every malformed or conflicting one is
a 400 naming its parameter, sent before anything reaches the engine; and a forced tool choice's output
comes back as `tool_calls`, streamed and not, in shapes the `openai` client reads and accumulates.

The HTTP tests run the real app on a scripted upstream: the engine's output is a text given per test,
token by token."""

import json

import pytest
from fastapi.testclient import TestClient
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.common.detokenizer import IncrementalDetokenizer
from services.common.pb import engine_pb2
from services.gateway import sse
from services.gateway.app import GatewayConfig, create_app
from services.gateway.errors import OpenAIError
from services.gateway.forced_tool_calls import ForcedToolCalls
from services.gateway.generation import plan_choices
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.tools import validate_tools
from services.gateway.validation import ModelFacts
from tests.gateway.test_validation import chat, completion, refused

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
StructuredOutput = engine_pb2.StructuredOutput


# --- request fields -> the engine's StructuredOutput ---

@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(json_schema=SCHEMA_TEXT)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json_schema=SCHEMA_TEXT)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, StructuredOutput(json_schema=SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": r"\d{3}"}}, StructuredOutput(regex=r"\d{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutput(choice=engine_pb2.Choices(choices=["yes", "no"]))),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutput(grammar='start: "a"+')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
    ({"structured_outputs": {"grammar": "root ::= [a-z]+", "disable_any_whitespace": True}},
     StructuredOutput(grammar="root ::= [a-z]+")),
    ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA_TEXT)),
    ({"guided_regex": "a|b"}, StructuredOutput(regex="a|b")),
    ({"guided_choice": ["x"]}, StructuredOutput(choice=engine_pb2.Choices(choices=["x"]))),
    ({"guided_grammar": 'start: "x"'}, StructuredOutput(grammar='start: "x"')),
])
@pytest.mark.parametrize("validate", [chat, completion])
def test_each_field_maps_to_the_engine_constraint(validate, fields, expected):
    assert validate(**fields).constraint.proto == expected


@pytest.mark.parametrize("fields", [
    {}, {"response_format": {"type": "text"}}, {"structured_outputs": {}},
    {"structured_outputs": {"json_object": False}}, {"guided_json": None},
])
def test_no_constraint(fields):
    assert chat(**fields).constraint is None


def test_schema_keeps_its_property_order_and_unicode():
    schema = {"type": "object", "properties": {"zeta": {"const": "é"}, "alpha": {"type": "integer"}}}
    text = chat(guided_json=schema).constraint.proto.json_schema
    assert text == '{"type":"object","properties":{"zeta":{"const":"é"},"alpha":{"type":"integer"}}}'


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex",
     "Only one structured output constraint is allowed per request"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.regex, structured_outputs.choice",
     "these are all set: structured_outputs.regex, structured_outputs.choice"),
    ({"guided_json": SCHEMA, "structured_outputs": {"json": SCHEMA}}, "structured_outputs.json, guided_json", None),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "needs json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "needs json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON schema (a JSON object), got an array"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format type 'xml' is not supported"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", None),
    ({"guided_json": 3}, "guided_json", "got a number"),
    ({"guided_json": [SCHEMA]}, "guided_json", "got an array"),
    ({"guided_json": True}, "guided_json", "got a boolean"),
    ({"structured_outputs": {"json": '"a string"'}}, "structured_outputs.json", "got a string"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "is not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one string"),
    ({"guided_grammar": "  "}, "guided_grammar", "give a Lark or GBNF grammar"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag", "not supported"),
])
@pytest.mark.parametrize("validate", [chat, completion])
def test_bad_constraints_are_400_naming_the_param(validate, fields, param, message):
    error = refused(validate, **fields)
    assert (error.status, error.param) == (400, param), error.message
    assert message is None or message in error.message


@pytest.mark.parametrize("fields", [{"guided_regex": 5}, {"guided_choice": "yes"}, {"structured_outputs": []},
                                    {"response_format": {"json_schema": {}}}, {"response_format": "json"}])
def test_wrong_types_are_refused_by_the_request_model(fields):
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_every_choice_of_every_prompt_carries_the_constraint():
    params = completion(n=3, structured_outputs={"regex": "[ab]+"})
    specs = plan_choices("cmpl-1", [[1, 2], [3]], [5, 5], params)
    assert len(specs) == 6
    assert all(spec.request.structured_output == StructuredOutput(regex="[ab]+") for spec in specs)
    assert not plan_choices("cmpl-2", [[1]], [5], completion())[0].request.HasField("structured_output")


# --- forced tool choices -> a JSON schema ---

def tool_use(**fields):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return validate_tools(ChatCompletionRequest(**body), tool_call_parser=None)


def forced_schema(**fields) -> dict:
    forced = tool_use(**fields).forced
    assert forced.constraint.param == "tool_choice"
    return json.loads(forced.constraint.proto.json_schema)


def test_required_is_an_array_of_calls_of_the_given_tools():
    schema = forced_schema(tools=[WEATHER, NOW], tool_choice="required")
    assert schema == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": SCHEMA},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["now"]},
                                          "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"], "additionalProperties": False}]}}
    assert tool_use(tools=[WEATHER], tool_choice="required").forced.function_name is None


def test_required_without_parallel_calls_allows_one_call():
    assert forced_schema(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)["maxItems"] == 1
    assert "maxItems" not in forced_schema(tools=[WEATHER], tool_choice="required", parallel_tool_calls=True)


def test_required_moves_the_tools_defs_to_the_root():
    city = {"type": "string", "enum": ["Paris", "Oslo"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"c": {"$ref": "#/$defs/City"}}, "$defs": {"City": city}}}}
    other = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"d": {"$ref": "#/$defs/City"}}, "$defs": {"City": city}}}}
    schema = forced_schema(tools=[tool, other], tool_choice="required")
    assert schema["$defs"] == {"City": city}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    clash = {"type": "function", "function": {"name": "h", "parameters": {"$defs": {"City": {"type": "integer"}}}}}
    with pytest.raises(OpenAIError) as info:
        tool_use(tools=[tool, clash], tool_choice="required")
    assert info.value.param == "tools" and "$defs.City" in info.value.message


def test_a_named_function_is_constrained_to_its_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_schema(tools=[NOW, WEATHER], tool_choice=named) == SCHEMA
    assert forced_schema(tools=[NOW], tool_choice={"type": "function", "function": {"name": "now"}}) == {
        "type": "object", "properties": {}}
    assert tool_use(tools=[WEATHER], tool_choice=named).forced.function_name == "get_weather"


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice",
     "Tool 'now' has not been passed in `tools`; tool_choice names one of: get_weather."),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", 'tool_choice must be "none"'),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice", None),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tool_choice": "required"},
     "tools.[0].function.parameters", "must be a JSON schema"),
])
def test_bad_tool_choices_are_400(fields, param, message):
    with pytest.raises(OpenAIError) as info:
        tool_use(**fields)
    assert (info.value.status, info.value.param) == (400, param)
    assert message is None or message in info.value.message


# --- the app on a scripted upstream ---

class ScriptedUpstream:
    """The engine answers every Generate with ``text``, one character per token (ids index ``pieces``),
    which the decoder turns back into text. Records the Generate requests."""

    def __init__(self) -> None:
        self.text = ""
        self.finish_reason = engine_pb2.FINISH_REASON_STOP
        self.requests: list[engine_pb2.GenerateRequest] = []
        self.pieces: list[str] = []
        self.decoder = _PieceDecoder(self.pieces)

    async def facts(self) -> ModelFacts:
        return ModelFacts(name="tiny", max_model_len=1000)

    async def encode_chat(self, *args) -> list[int]:
        return [1, 2, 3]

    async def encode(self, *args) -> list[int]:
        return [1, 2, 3]

    def generate(self, request: engine_pb2.GenerateRequest):
        self.requests.append(request)
        ids = []
        for piece in self.text:
            ids.append(len(self.pieces))
            self.pieces.append(piece)
        return _Call(self._outputs(ids))

    async def _outputs(self, ids):
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            yield engine_pb2.GenerateResponse(token_ids=[token_id], finish_reason=self.finish_reason if last else 0,
                                              usage=engine_pb2.Usage(prompt_tokens=3, completion_tokens=i + 1))


class _Call:
    def __init__(self, outputs) -> None:
        self._outputs = outputs

    def __aiter__(self):
        return self._outputs

    def cancel(self) -> None:
        pass


class _PieceDecoder:
    def __init__(self, pieces: list[str]) -> None:
        self._pieces = pieces

    def detokenizer(self, skip_special_tokens: bool, prefix_ids) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(lambda ids: "".join(self._pieces[i] for i in ids))


@pytest.fixture(scope="module")
def app_client():
    config = GatewayConfig(tokenizer_addr="127.0.0.1:9", engine_addr="127.0.0.1:9", served_model_name="tiny")
    with TestClient(create_app(config)) as client:
        yield client


@pytest.fixture
def upstream(app_client):
    scripted = ScriptedUpstream()
    app_client.app.state.gateway.upstream = scripted
    return scripted


def post_chat(client, **fields):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
     "response_format, guided_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"guided_json": [1, 2]}, "guided_json"),
    ("/v1/chat/completions", {"guided_regex": 7}, "guided_regex"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "guided_json": SCHEMA},
     "guided_json, tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "stream": True,
                              "response_format": {"type": "json_object"}}, "response_format, tool_choice"),
    ("/v1/completions", {"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "grammar": "b"}, "stream": True},
     "structured_outputs.regex, structured_outputs.grammar"),
])
def test_a_bad_request_is_a_400_and_reaches_no_engine(app_client, upstream, path, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    response = app_client.post(path, json={**body, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert upstream.requests == []


def test_the_constraint_reaches_every_generate_call(app_client, upstream):
    upstream.text = '{"city":"Oslo"}'
    response = post_chat(app_client, n=2, response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": SCHEMA, "strict": True}})
    assert response.status_code == 200
    assert [r.structured_output for r in upstream.requests] == [StructuredOutput(json_schema=SCHEMA_TEXT)] * 2
    assert [c["message"]["content"] for c in response.json()["choices"]] == ['{"city":"Oslo"}'] * 2


def stream_chunks(response) -> list[ChatCompletionChunk]:
    assert response.status_code == 200, response.text
    events = sse.parse(response.text)
    assert events[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate(event) for event in events[:-1]]


def accumulate(chunks: list[ChatCompletionChunk]) -> ChatCompletion:
    """What the openai client's own accumulator makes of a stream."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion()


CALLS = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"now","parameters":{}}]'


@pytest.mark.parametrize("stream", [False, True])
def test_required_returns_the_calls(app_client, upstream, stream):
    upstream.text = CALLS
    response = post_chat(app_client, tools=[WEATHER, NOW], tool_choice="required", stream=stream)
    completion_ = accumulate(stream_chunks(response)) if stream else ChatCompletion.model_validate(response.json())
    choice = completion_.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("now", {})]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_required_streams_each_call_once_its_object_is_complete(app_client, upstream):
    upstream.text = CALLS
    chunks = stream_chunks(post_chat(app_client, tools=[WEATHER, NOW], tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and deltas[0].content is None and not deltas[0].tool_calls
    with_calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert [[(c.index, c.function.name) for c in calls] for calls in with_calls] == [[(0, "get_weather")], [(1, "now")]]
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_returns_one_call_with_the_output_as_arguments(app_client, upstream, stream):
    upstream.text = '{"city":"Zürich"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = post_chat(app_client, tools=[NOW, WEATHER], tool_choice=named, stream=stream)
    completion_ = accumulate(stream_chunks(response)) if stream else ChatCompletion.model_validate(response.json())
    choice = completion_.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Zürich"})
    assert call.id.startswith("chatcmpl-tool-")
    assert upstream.requests[-1].structured_output == StructuredOutput(json_schema=SCHEMA_TEXT)


def test_a_named_function_streams_its_arguments_as_they_come(app_client, upstream):
    upstream.text = '{"city":"Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = stream_chunks(post_chat(app_client, n=2, tools=[WEATHER], tool_choice=named, stream=True))
    for index in (0, 1):
        deltas = [c.choices[0].delta for c in chunks if c.choices[0].index == index]
        opening = deltas[0].tool_calls[0]
        assert deltas[0].role == "assistant" and deltas[0].content is None
        assert (opening.index, opening.type, opening.function.name, opening.function.arguments) == (
            0, "function", "get_weather", "")
        pieces = [d.tool_calls[0] for d in deltas[1:] if d.tool_calls]
        assert len(pieces) == len(upstream.text)  # one per token
        assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
        assert "".join(p.function.arguments for p in pieces) == upstream.text
    assert len({c.choices[0].delta.tool_calls[0].id for c in chunks if c.choices[0].delta.role}) == 2


def test_a_call_cut_by_max_tokens_keeps_length_as_its_finish_reason():
    forced = ForcedToolCalls(None)
    message, finish_reason = forced.message('[{"name":"now","parameters":{}},{"name":"get_w', "length")
    assert finish_reason == "length" and [c["function"]["name"] for c in message["tool_calls"]] == ["now"]
    message, finish_reason = ForcedToolCalls("f").message('{"a":', "length")
    assert finish_reason == "length" and message["tool_calls"][0]["function"]["arguments"] == '{"a":'


def test_required_output_cut_anywhere_gives_the_same_calls():
    text = '[{"name":"a","parameters":{"s":"}{]["}} , {"name":"b","parameters":{"n":[1,{"x":2}]}}]'
    whole, _ = ForcedToolCalls(None).message(text, "stop")
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert expected == [("a", '{"s": "}{]["}'), ("b", '{"n": [1, {"x": 2}]}')]
    for cut in range(len(text) + 1):
        forced, calls = ForcedToolCalls(None), []
        for piece in (text[:cut], text[cut:]):
            delta, finish_reason = forced.stream_delta(0, piece, None)
            calls += delta.get("tool_calls", [])
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (i, name, arguments) for i, (name, arguments) in enumerate(expected)], cut
