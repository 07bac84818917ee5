"""Structured output through the real stack and the real `openai` client (issue #13). The built-in model
has random weights, so every valid output is the constraint's doing: at temperature 1, over several
seeds, every output of 30+ JSON schemas validates with `jsonschema`, every regex output full-matches,
every choice is one of the choices, every grammar output parses; forced tool choices return tool calls
whose arguments validate, streamed and not; the client's `parse` with a pydantic model works; a bad
schema, regex or grammar is a 400 with the engine's reason and nothing left queued; a stream gives the
text of the same seed's response. Requests run 16 at a time (the stack's --max-num-seqs).

Strings and numbers in the schemas are bounded (enum, maxLength, pattern, minimum/maximum) so that a
random model ends within max_tokens: an output cut at max_tokens ("length") counts as a failure."""

import datetime
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import jsonschema
import lark
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL, engine_load

SEEDS = (11, 22, 33)
MAX_TOKENS = 400
MESSAGES = [{"role": "user", "content": "Reply in the requested format."}]


def obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object; every property required unless ``required`` says otherwise."""
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required}


NAME = {"type": "string", "maxLength": 12}
SMALL = {"type": "integer", "minimum": 0, "maximum": 100}
SCHEMAS = {
    "flat": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "bool and enum": obj({"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}}),
    "nested": obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                         "minItems": 1, "maxItems": 3}})}),
    "array of ints": {"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10},
                      "minItems": 2, "maxItems": 5},
    "anyOf scalars": obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                              {"enum": ["x", "y"]}]}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "date": obj({"day": {"type": "string", "format": "date"}}),
    "email": obj({"email": {"type": "string", "format": "email", "maxLength": 24}}),
    "number range": obj({"x": {"type": "number", "minimum": 0, "maximum": 1},
                         "y": {"type": "number", "minimum": -5.5, "maximum": 5.5}}),
    "optional properties": obj({"a": SMALL, "b": {"type": "boolean"}, "c": NAME}, required=["a"]),
    "const": obj({"version": {"const": 2}, "kind": {"const": "report"}}),
    "nullable": obj({"note": {"type": ["string", "null"], "maxLength": 5}}),
    "oneOf disjoint": obj({"id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                            {"type": "string", "pattern": "^[a-f]{4}$"}]}}),
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": obj({"k": {"enum": ["p", "q"]},
                                       "v": {"type": "integer", "minimum": 0, "maximum": 5}})},
    "three levels": obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    "enum of numbers": obj({"n": {"enum": [1, 2.5, -3, 100]}}),
    "exclusive bounds": obj({"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}),
    "multipleOf": obj({"m": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}}),
    "defs and ref": {"type": "object", "additionalProperties": False, "required": ["home", "work"],
                     "properties": {"home": {"$ref": "#/$defs/place"}, "work": {"$ref": "#/$defs/place"}},
                     "$defs": {"place": obj({"city": {"enum": ["Oslo", "Lima"]}, "floor": SMALL})}},
    "uuid": obj({"id": {"type": "string", "format": "uuid"}}),
    "ipv4": obj({"ip": {"type": "string", "format": "ipv4"}}),
    "date-time": obj({"at": {"type": "string", "format": "date-time"}}),
    "string length": obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "tuple": {"type": "array", "prefixItems": [SMALL, {"enum": ["x", "y"]}, {"type": "boolean"}],
              "items": False, "minItems": 3},
    "top-level boolean": {"type": "boolean"},
    "top-level enum": {"enum": ["alpha", "beta", "gamma delta"]},
    "optional arrays": obj({"id": SMALL, "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
                            "ys": {"type": "array", "items": SMALL, "maxItems": 2}}, required=["id"]),
    "alternation pattern": obj({"req": {"type": "string", "pattern": "^(GET|POST) /[a-z]{1,8}$"}}),
    "negative range": obj({"n": {"type": "integer", "minimum": -1000000, "maximum": -1000}}),
    "tagged union": obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": SMALL}),
                                             obj({"kind": {"const": "square"}, "side": SMALL})]}}),
    "matrix": obj({"rows": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}}}),
    "allOf": {"allOf": [obj({"a": SMALL, "b": {"type": "boolean"}}, required=["a"]),
                        {"required": ["b"]}]},
    "mixed record": obj({"title": {"type": "string", "maxLength": 16}, "score": {"type": "number", "minimum": 0,
                                                                              "maximum": 10},
                         "level": {"enum": ["low", "mid", "high"]}, "when": {"type": "string", "format": "date"},
                         "flags": {"type": "array", "items": {"enum": ["new", "hot"]}, "maxItems": 2}},
                        required=["title", "level"]),
}

FORMATS = jsonschema.FormatChecker()  # date, email, ipv4, uuid..., and date-time without an extra package
_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\d)[Tt](\d\d:\d\d):(\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)")


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    """RFC 3339's date-time ('t' and 'z' may be lower case, a second may be a leap second, 60)."""
    if not isinstance(value, str):
        return True
    match = _RFC3339.fullmatch(value)
    if not match:
        return False
    day, hours_minutes, second, _, offset = match.groups()
    offset = "+00:00" if offset in "Zz" else offset
    datetime.datetime.fromisoformat(f"{day}T{hours_minutes}:{min(int(second), 59):02d}{offset}")
    return int(second) <= 60


def schema_errors(schema: dict, text: str) -> str | None:
    """Why ``text`` is not a JSON value valid against ``schema``; None when it is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not JSON: {error}"
    errors = [e.message for e in jsonschema.Draft202012Validator(schema, format_checker=FORMATS).iter_errors(value)]
    return "; ".join(errors) or None


def run_all(jobs):
    """Runs ``(key, call)`` pairs 16 at a time; returns ``{key: call()}``."""
    with ThreadPoolExecutor(16) as pool:
        futures = {key: pool.submit(call) for key, call in jobs}
        return {key: future.result() for key, future in futures.items()}


def chat_text(client, seed: int, max_tokens: int = MAX_TOKENS, **kwargs) -> tuple[str, str]:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=max_tokens, **kwargs)
    return response.choices[0].message.content, response.choices[0].finish_reason


def completion_text(client, seed: int, **kwargs) -> tuple[str, str]:
    response = client.completions.create(model=MODEL, prompt="Output:", temperature=1.0, seed=seed,
                                         max_tokens=MAX_TOKENS, **kwargs)
    return response.choices[0].text, response.choices[0].finish_reason


def schema_request(client, schema: dict, seed: int, way: int) -> tuple[str, str]:
    """One request for ``schema`` by one of the three ways a client can ask for it."""
    if way == 0:
        return chat_text(client, seed, response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema, "strict": True}})
    if way == 1:
        return completion_text(client, seed, extra_body={"structured_outputs": {"json": schema}})
    return chat_text(client, seed, extra_body={"guided_json": json.dumps(schema)})


def test_json_schemas_at_temperature_1(client):
    assert len(SCHEMAS) >= 30
    jobs = [((name, seed), lambda s=schema, seed=seed, way=(i + j) % 3: schema_request(client, s, seed, way))
            for i, (name, schema) in enumerate(SCHEMAS.items()) for j, seed in enumerate(SEEDS)]
    failures = []
    for (name, seed), (text, finish_reason) in run_all(jobs).items():
        problem = "cut at max_tokens" if finish_reason != "stop" else schema_errors(SCHEMAS[name], text)
        if problem:
            failures.append(f"{name} (seed {seed}): {problem}: {text!r}")
    assert not failures, "\n".join(failures)


def test_n_choices_each_follow_the_schema(client):
    schema = SCHEMAS["mixed record"]
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=5, n=3,
                                              max_tokens=MAX_TOKENS, response_format=response_format)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert schema_errors(schema, choice.message.content) is None
    assert len({c.message.content for c in response.choices}) > 1  # each choice its own sample


def test_json_object(client):
    """Any object: its strings and keys are unbounded, so a random model may not close it within max_tokens;
    what it wrote is an object's start either way, and a whole object when it ended by itself."""
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=5, n=4,
                                              max_tokens=48, response_format={"type": "json_object"})
    for choice in response.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length"


REGEXES = [r"\d{3}-\d{4}", r"(cat|dog|bird)s?", r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)", r"-?(0|[1-9]\d{0,3})(\.\d{1,2})?",
           r"[A-F0-9]{8}", r"(yes|no)( maybe)?", r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}"]
CHOICES = ["red", "green", "blue", "a longer choice with spaces", "ünïcödé ✓"]
LARK = """
start: greeting " " name (", " name)~0..2 "!"
greeting: "hello" | "hi" | "hey"
name: /[A-Z][a-z]{1,8}/
"""
GBNF = """
root ::= answer " " number
answer ::= "yes" | "no" | "maybe"
number ::= [1-9] [0-9]? [0-9]?
"""
GBNF_LANGUAGE = r"(yes|no|maybe) [1-9][0-9]{0,2}"


def test_regexes_choices_and_grammars(client):
    jobs = []
    for seed in SEEDS:
        for i, regex in enumerate(REGEXES):
            body = {"structured_outputs": {"regex": regex}} if i % 2 else {"guided_regex": regex}
            call = completion_text if i % 2 else chat_text
            jobs.append((("regex", regex, seed), lambda c=call, b=body, s=seed: c(client, s, extra_body=b)))
        jobs.append((("choice", None, seed), lambda s=seed: chat_text(
            client, s, extra_body={"guided_choice": CHOICES})))
        jobs.append((("choice", None, -seed), lambda s=seed: completion_text(
            client, s, extra_body={"structured_outputs": {"choice": CHOICES}})))
        jobs.append((("lark", None, seed), lambda s=seed: chat_text(
            client, s, extra_body={"structured_outputs": {"grammar": LARK}})))
        jobs.append((("gbnf", None, seed), lambda s=seed: completion_text(
            client, s, extra_body={"guided_grammar": GBNF})))
    parser = lark.Lark(LARK)
    failures = []
    for (kind, regex, seed), (text, finish_reason) in run_all(jobs).items():
        if finish_reason != "stop":
            failures.append(f"{kind} {regex} (seed {seed}): cut at max_tokens: {text!r}")
        elif kind == "regex" and not re.fullmatch(regex, text):
            failures.append(f"{regex} (seed {seed}): {text!r} does not match")
        elif kind == "choice" and text not in CHOICES:
            failures.append(f"choice (seed {seed}): {text!r}")
        elif kind == "gbnf" and not re.fullmatch(GBNF_LANGUAGE, text):
            failures.append(f"gbnf (seed {seed}): {text!r}")
        elif kind == "lark":
            try:
                parser.parse(text)
            except lark.LarkError as error:
                failures.append(f"lark (seed {seed}): {text!r}: {error}")
    assert not failures, "\n".join(failures)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": obj({"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                              required=["city"])}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": obj(
    {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,9}/[A-Z][a-z]{2,9}$"}})}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


def tool_request(client, seed: int, stream: bool, tool_choice, parallel_tool_calls: bool | None = None):
    """(tool calls, content, finish reason) of one chat request, accumulated by the client when streamed."""
    kwargs = {"parallel_tool_calls": parallel_tool_calls} if parallel_tool_calls is not None else {}
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                              tool_choice=tool_choice, temperature=1.0, seed=seed,
                                              max_tokens=MAX_TOKENS, stream=stream, **kwargs)
    if stream:
        state = ChatCompletionStreamState()
        for chunk in response:
            state.handle_chunk(chunk)
        response = state.get_final_completion()
    choice = response.choices[0]
    return choice.message.tool_calls or [], choice.message.content, choice.finish_reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_streamed_and_not(client, tool_choice):
    jobs = [((seed, stream, parallel),
             lambda s=seed, st=stream, p=parallel: tool_request(client, s, st, tool_choice, p))
            for seed in SEEDS for stream in (False, True) for parallel in (None, False)]
    failures = []
    for key, (calls, content, finish_reason) in run_all(jobs).items():
        expected_finish = "tool_calls" if tool_choice == "required" else "stop"
        if finish_reason != expected_finish or content is not None or not calls:
            failures.append(f"{key}: finish {finish_reason}, content {content!r}, {len(calls)} calls")
            continue
        if tool_choice != "required" or key[2] is False:
            assert len(calls) == 1, key
        for call in calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            if tool_choice != "required":
                assert call.function.name == "get_time"
            problem = schema_errors(PARAMETERS[call.function.name], call.function.arguments)
            if problem:
                failures.append(f"{key} {call.function.name}: {problem}: {call.function.arguments!r}")
        assert len({call.id for call in calls}) == len(calls)
    assert not failures, "\n".join(failures)


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)
    country: Literal["FR", "DE", "NO"]
    landmarks: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)
    capital: bool


def test_parse_with_a_pydantic_model(client):
    parsers = [client.chat.completions.parse]
    if hasattr(client, "beta") and hasattr(client.beta, "chat"):  # older clients have parse under beta only
        parsers.append(client.beta.chat.completions.parse)
    jobs = [((i, seed), lambda p=parse, s=seed: p(model=MODEL, messages=MESSAGES, response_format=City,
                                                   temperature=1.0, seed=s, max_tokens=MAX_TOKENS))
            for i, parse in enumerate(parsers) for seed in SEEDS]
    for completion in run_all(jobs).values():
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, City)
        assert message.parsed == City.model_validate_json(message.content)


@pytest.mark.parametrize("extra_body, reason", [
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "uniqueItems"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "invalid JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "invalid grammar"),
    ({"guided_grammar": "root ::= \"a\" missing"}, "invalid grammar"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_constraint_is_a_400_with_the_reason(client, engine, extra_body, reason, stream):
    with pytest.raises(openai.BadRequestError) as info:
        chat_text(client, 1, extra_body=extra_body, stream=stream)
    assert info.value.status_code == 400
    assert reason in info.value.body["message"], info.value.body
    load = engine_load(engine)
    assert (load.num_running, load.num_waiting) == (0, 0)
    text, finish_reason = chat_text(client, 1, max_tokens=4)  # still serving
    assert finish_reason in ("stop", "length")


def test_a_stream_gives_the_text_of_the_same_seed(client):
    schema = SCHEMAS["mixed record"]
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}

    def streamed(seed: int) -> tuple[str, str]:
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed,
                                                     max_tokens=MAX_TOKENS, stream=True, **body))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].choices[0].finish_reason

    jobs = [((seed, way), lambda s=seed, w=way: streamed(s) if w else chat_text(client, s, **body))
            for seed in SEEDS for way in (0, 1)]
    results = run_all(jobs)
    for seed in SEEDS:
        assert results[(seed, 0)] == results[(seed, 1)]
        assert schema_errors(schema, results[(seed, 0)][0]) is None
