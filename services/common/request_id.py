"""The request id of the request being served, carried from hop to hop.

The gateway takes the client's ``x-request-id`` header (or makes one) and sends it on as
``x-request-id`` gRPC metadata on every call it makes for the request; each gRPC server binds it
(`services.common.grpc_server`) and passes it on the same way (`services.common.client_span`).
While a request is served, ``current()`` returns its id: log lines carry it
(`services.common.logging_setup`) and every span has it as ``strata.request_id``.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token

METADATA_KEY = "x-request-id"  # the HTTP header and the gRPC metadata key alike
SPAN_ATTRIBUTE = "strata.request_id"

_current: ContextVar[str | None] = ContextVar("strata_request_id", default=None)


def current() -> str | None:
    """The id of the request this code serves, or None outside a request."""
    return _current.get()


@contextmanager
def bound(request_id: str | None) -> Iterator[None]:
    """``request_id`` is current for the block (in this task and the tasks it creates)."""
    token = bind(request_id)
    try:
        yield
    finally:
        unbind(token)


def bind(request_id: str | None) -> Token:
    """``request_id`` is current until ``unbind(token)``, in the same task (``bound`` without a
    context manager's cost, for a stream's every message)."""
    return _current.set(request_id)


def unbind(token: Token) -> None:
    _current.reset(token)
