"""Reading a request's JSON body at the edge, before pydantic sees it.

JSON may carry a lone UTF-16 surrogate (``"\\ud800"``; Python's ``json`` also decodes the raw bytes
ED A0 80 to one), which no later step can encode: protobuf, the tokenizer and the response writer
all need valid Unicode. Such a body is a 400 naming the first field that holds one, here, rather
than a 500 wherever it is first encoded. A body that is not UTF-8 JSON is a 400 too.

Routes that take a pydantic body use ``JsonBodyRoute`` (``APIRouter(route_class=JsonBodyRoute)``).
The parse stays on the event loop: ``json.loads`` and pydantic hold the GIL, so a thread would not
let the loop run meanwhile; instead the work is kept linear and small (a 4 MB text prompt parses
and checks in a few milliseconds; a huge list of token ids is dispatched by shape, see
``protocol.Prompt``).
"""

import json
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from services.gateway import errors

# Where a lone surrogate can come from: a \uD800-\uDFFF escape, or the CESU-8 bytes ED A0..BF.
# A match only means "look closer" (an escaped backslash before "ud800" matches too). Two patterns,
# each with a literal first byte, scan 8 MB in a few milliseconds; one alternation takes ten times as long.
_MAYBE_SURROGATE = (re.compile(rb"\\u[dD][89a-fA-F]"), re.compile(rb"\xed[\xa0-\xbf]"))


def parse_json_body(body: bytes) -> Any:
    """The parsed body; raises ``OpenAIError`` 400 for non-UTF-8 bytes or a lone surrogate, and
    ``json.JSONDecodeError`` (FastAPI's own 400) for malformed JSON."""
    try:
        value = json.loads(body)
    except UnicodeDecodeError as error:
        raise errors.bad_request(f"Request body is not valid UTF-8: {error.reason} at byte {error.start}.")
    if any(pattern.search(body) for pattern in _MAYBE_SURROGATE):
        path = _lone_surrogate_path(value)
        if path is not None:
            where = ".".join(str(p) for p in path) or "body"
            raise errors.bad_request(
                f"{where} is not valid Unicode: it holds a lone UTF-16 surrogate (\\ud800-\\udfff) "
                "that is not part of a pair.", param=where if path else None)
    return value


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate_path(value: Any) -> list[str | int] | None:
    """The path (keys and indices) of the first string, object key included, with a lone
    surrogate; None if there is none. Iterative: a deeply nested body cannot overflow the stack."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                return path
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _has_lone_surrogate(key):
                    return path + [key.encode("utf-8", "backslashreplace").decode()]
                stack.append((child, path + [key]))
        elif isinstance(item, list):
            stack.extend((child, path + [i]) for i, child in reversed(list(enumerate(item))))
    return None


class JsonBodyRequest(Request):
    """A request whose ``json()`` is ``parse_json_body``."""

    async def json(self) -> Any:
        if not hasattr(self, "_parsed_json"):
            self._parsed_json = parse_json_body(await self.body())
        return self._parsed_json


class JsonBodyRoute(APIRoute):
    """An APIRoute whose handler reads the body with ``JsonBodyRequest``."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(JsonBodyRequest(request.scope, request.receive))

        return handle
