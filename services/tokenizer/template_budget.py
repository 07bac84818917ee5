"""What one chat-template render may spend: a deadline, and a size no string, list or output may pass.

A template runs as Python code on a worker thread, holding the GIL, and a thread cannot be stopped
from outside; so a render checks its own budget, at the points `bounded_sandbox.py` instruments:
`tick()` at every loop iteration, call, filter and output piece ends a render past its deadline, and
`check_size()` refuses a value over the size limit before it is built, so that it never takes the
memory. The budget of the render running on this thread is `current_budget()`, set by `spending()`.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2.utils import Namespace

from services.common.errors import InvalidRequestError

# A request's own template is compiled before any deadline can run (Jinja compiles ~200 kB/s).
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024
# The largest integer a template may compute (about 20,000 digits); Python's arithmetic on larger
# ones runs in C for as long as it takes.
MAX_INT_BITS = 1 << 16


@dataclass(frozen=True)
class TemplateLimits:
    """Limits on rendering one chat template, the checkpoint's or a request's.

    `max_chars` bounds every string or list the render builds and its output, unless twice the size
    of the messages and template kwargs is more (a prompt near the body limit still renders).
    """

    timeout_s: float = 1.0
    max_chars: int = 4 << 20

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"--chat-template-timeout {self.timeout_s} must be more than 0 seconds")
        if self.max_chars < 1024:
            raise ValueError(f"--max-chat-template-chars {self.max_chars} is too small; use at least 1024")


class TemplateLimitError(InvalidRequestError):
    """A chat template that exceeded its render budget (INVALID_ARGUMENT: it would every time)."""


class RenderBudget:
    """The budget of one render: a deadline `limits.timeout_s` from now and a size limit."""

    def __init__(self, limits: TemplateLimits, num_input_chars: int) -> None:
        self.timeout_s = limits.timeout_s
        self.deadline = time.monotonic() + limits.timeout_s
        self.max_chars = max(limits.max_chars, 2 * num_input_chars)

    def tick(self) -> None:
        """Raises TemplateLimitError once the deadline has passed."""
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"the chat template exceeded its time limit of {self.timeout_s:g} s (--chat-template-timeout)"
            )

    def check_size(self, num_chars: int, what: str) -> None:
        """Raises TemplateLimitError if `what` would hold more than `max_chars` characters (or items)."""
        if num_chars > self.max_chars:
            raise TemplateLimitError(
                f"the chat template exceeded its size limit: {what} of {num_chars} characters or items, over "
                f"{self.max_chars} (--max-chat-template-chars, or twice the size of the messages if more)"
            )

    def check_length(self, value: Any, what: str) -> None:
        """`check_size` for a value already built, if it has a length."""
        if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
            self.check_size(len(value), what)

    def check_weight(self, value: Any, what: str) -> None:
        """`check_size` for the text `str(value)` would make."""
        self.check_size(weight(value, self.max_chars), what)

    @contextmanager
    def spending(self) -> Iterator["RenderBudget"]:
        """Makes this the `current_budget()` of this thread while the block runs."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)


_current: ContextVar[RenderBudget] = ContextVar("chat_template_budget")


def current_budget() -> RenderBudget:
    """The budget of the render running on this thread (LookupError outside `RenderBudget.spending`)."""
    return _current.get()


def weight(value: Any, limit: int | None = None) -> int:
    """About how many characters `str(value)` or JSON of it has: exact for a string, for containers
    their items' weights plus 2 per item. Counting stops once past `limit`, so the cost is bounded
    by it (and a namespace that holds itself is counted until then)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        total += 2
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.extend(item)
        elif isinstance(item, Namespace):
            pending.append(item._Namespace__attrs)  # its attributes, as its repr shows them
        elif isinstance(item, int):
            total += item.bit_length() * 3 // 10  # decimal digits
        else:
            total += 16
        if limit is not None and total > limit:
            break
    return total
