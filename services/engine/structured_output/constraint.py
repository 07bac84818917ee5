"""A request's structured-output constraint as the engine keeps it: a kind and its source text."""

import json
from dataclasses import dataclass

from services.common.pb import engine_pb2

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    source: str  # the schema's JSON text, the regex, the grammar; for choice, a JSON list of the strings
    starts_after: tuple[int, ...] = ()  # it applies once the output ends with these tokens (a thought's end)

    @property
    def key(self) -> tuple[str, str]:
        """What compiled grammars are cached by."""
        return self.kind, self.source


def constraint_from_proto(message: engine_pb2.StructuredOutput) -> Constraint | None:
    """None when the request has no constraint."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    starts_after = tuple(message.starts_after)
    if kind == "choice":
        return Constraint(kind, json.dumps(list(message.choice.choices)), starts_after)
    if kind == "json_object":
        return Constraint(kind, "", starts_after) if message.json_object else None
    return Constraint(kind, getattr(message, kind), starts_after)

