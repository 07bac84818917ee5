"""Structured output: a request's constraint on its output, as the engine's ``StructuredOutput``.

Where a constraint can come from (each named as its parameter in errors):
  ``response_format``         OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema",
                              "json_schema": {"name", "schema", "strict"}}``; ``{"type": "text"}`` is none.
  ``structured_outputs.<k>``  vLLM's extra body: ``json`` (a schema, object or JSON text), ``regex``,
                              ``choice``, ``grammar`` (Lark or GBNF), ``json_object``.
  ``guided_<k>``              vLLM's older names: ``guided_json``, ``guided_regex``, ``guided_choice``,
                              ``guided_grammar``.
  ``tool_choice``             ``"required"`` or a named function (``tools.py``).

A request has at most one; two are a 400 naming both. The gateway checks the shape (a schema is a JSON
object, choices are not empty); whether a schema, regex or grammar compiles is the engine's to say,
as INVALID_ARGUMENT (a 400 with its reason) before anything is queued. Every choice of the request
(n, several prompts) gets the same constraint.
"""

import json
from dataclasses import dataclass
from typing import Any

from services.common.pb import engine_pb2
from services.gateway import errors
from services.gateway.protocol import SamplingFields, StructuredOutputsParams


@dataclass(frozen=True)
class Constraint:
    """One constraint and the request parameter it came from."""
    param: str
    proto: engine_pb2.StructuredOutput


def json_schema(schema: Any, param: str) -> Constraint:
    """A JSON schema given as an object or as its JSON text; anything but an object is a 400."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise errors.bad_request(f"{param} is not valid JSON: {error}.", param=param) from None
    if not isinstance(schema, dict):
        raise errors.bad_request(f"{param} must be a JSON schema (a JSON object), got {_kind(schema)}.", param=param)
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    return Constraint(param, engine_pb2.StructuredOutput(json_schema=text))


def request_constraint(req: SamplingFields) -> Constraint | None:
    """The constraint of a chat or completion request's own fields (tools aside); None if it has none."""
    found = []
    if req.response_format is not None:
        found += _response_format(req)
    if req.structured_outputs is not None:
        found += _structured_outputs(req.structured_outputs)
    found += _by_kind({"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
                       "grammar": req.guided_grammar}, "guided_{}")
    return only_one(*found)


def only_one(*constraints: Constraint | None) -> Constraint | None:
    """The one constraint given, None for none; more than one is a 400 naming them all."""
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        names = ", ".join(c.param for c in given)
        raise errors.bad_request(f"Only one structured output constraint is allowed per request, but these "
                                 f"are all set: {names}. Keep one of them.", param=names)
    return given[0] if given else None


def _response_format(req: SamplingFields) -> list[Constraint]:
    response_format = req.response_format
    kind = response_format.type
    if kind == "text":
        return []
    if kind == "json_object":
        return [Constraint("response_format", engine_pb2.StructuredOutput(json_object=True))]
    if kind == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise errors.bad_request('response_format of type "json_schema" needs json_schema.schema, the JSON '
                                     "schema the output must follow.", param="response_format.json_schema.schema")
        return [Constraint("response_format", json_schema(spec.schema_, "response_format.json_schema.schema").proto)]
    raise errors.bad_request(f"response_format type {kind!r} is not supported; use one of 'text', 'json_object', "
                             "'json_schema'.", param="response_format.type")


def _structured_outputs(params: StructuredOutputsParams) -> list[Constraint]:
    if params.structural_tag is not None:
        raise errors.bad_request("structured_outputs.structural_tag is not supported; use json, regex, choice "
                                 "or grammar.", param="structured_outputs.structural_tag")
    found = _by_kind({"json": params.json_, "regex": params.regex, "choice": params.choice,
                      "grammar": params.grammar}, "structured_outputs.{}")
    if params.json_object:
        found.append(Constraint("structured_outputs.json_object", engine_pb2.StructuredOutput(json_object=True)))
    return found


def _by_kind(values: dict[str, Any], param_format: str) -> list[Constraint]:
    """The constraints among vLLM's four kinds (json, regex, choice, grammar) that are set, each named by
    ``param_format`` (``structured_outputs.{}`` or the older ``guided_{}``)."""
    build = {"json": json_schema, "regex": lambda regex, param: Constraint(param, engine_pb2.StructuredOutput(
        regex=regex)), "choice": _choice, "grammar": _grammar}
    return [build[kind](value, param_format.format(kind)) for kind, value in values.items() if value is not None]


def _choice(choices: list[str], param: str) -> Constraint:
    if not choices:
        raise errors.bad_request(f"{param} must hold at least one string to choose from.", param=param)
    return Constraint(param, engine_pb2.StructuredOutput(choice=engine_pb2.Choices(choices=choices)))


def _grammar(grammar: str, param: str) -> Constraint:
    if not grammar.strip():
        raise errors.bad_request(f"{param} is empty; give a Lark or GBNF grammar.", param=param)
    return Constraint(param, engine_pb2.StructuredOutput(grammar=grammar))


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return "null" if value is None else type(value).__name__
