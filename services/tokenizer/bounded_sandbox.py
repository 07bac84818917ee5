"""A Jinja sandbox whose renders stay within their `RenderBudget` (template_budget.py) of time and size.

On top of `ImmutableSandboxedEnvironment` (no attribute that starts with `_`, no changing lists or
dicts, `range` of at most 100,000 items), every render of a `BoundedSandboxedEnvironment` template
must run inside `RenderBudget.spending()`, and then:

- Time. Each `{% for %}` iterates through `_counted`, which ticks the budget per item (the parsed
  template's loops are rewritten to `for x in (items)|strata_counted_loop`, recursive loops'
  `loop(items)` calls too), and so do every call, filter and output piece. A template can only
  repeat work through loops or calls, so even empty nested loops end within a tick of the deadline.
- Size. What could make a large string or list from small ones is checked before it runs: `*`,
  `+`, `%` and `**` (`call_binop`), `~` (`join_concat`, by the code generator), the text every
  `{{ }}` and every filter that makes text would make of a container (`check_weight`), the str
  methods and filters whose result can be much larger than their input (center, ljust, replace,
  join, format, indent, ...: estimated from their arguments), and the output joined at the end
  and by macros and blocks (`concat`). Every call's and filter's result is checked after it.

`lipsum` is left out (a loop in Python that no check reaches); everything else renders as in
Jinja's sandbox, which is what transformers' `apply_chat_template` uses.
"""

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext, markup_join, str_join
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.utils import pass_context

from services.tokenizer.template_budget import MAX_INT_BITS, RenderBudget, TemplateLimitError, current_budget, weight

COUNTED_LOOP_FILTER = "strata_counted_loop"
# Filters that turn their value into text: a container's weight must fit before it is stringified.
_TEXT_FILTERS = frozenset({
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join", "lower", "pprint",
    "replace", "safe", "string", "striptags", "title", "tojson", "trim", "truncate", "upper", "urlencode",
    "urlize", "wordcount", "wordwrap", "xmlattr",
})
_MAX_JSON_INDENT = 16
# The width and precision of a printf-style field ("*": taken from the values).
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
# The format spec of a str.format field, nested fields ({:{width}}) included.
_BRACE_SPEC = re.compile(r"\{[^{}]*?:((?:[^{}]|\{[^{}]*\})*)\}")


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with `a ~ b` joined by the environment's `join_concat`, which checks the size."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.join_concat(context.eval_ctx, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """A sandbox that keeps each render within the caller's `RenderBudget`; `filters` and `globals`
    are added to Jinja's (filters get the same checks)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, *, filters: Mapping[str, Callable] | None = None, globals: Mapping[str, Any] | None = None,
                 **options) -> None:
        super().__init__(finalize=_checked_output, **options)
        self.filters = {name: _bounded_filter(name, func) for name, func in {**self.filters, **(filters or {})}.items()}
        self.filters[COUNTED_LOOP_FILTER] = _counted_loop
        self.globals.pop("lipsum", None)
        self.globals.update(globals or {})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Parses as Jinja does (this is the step `compile` calls), then counts every loop's items."""
        template = super()._parse(source, name, filename)
        for loop in list(template.find_all(nodes.For)):
            loop.iter = nodes.Filter(loop.iter, COUNTED_LOOP_FILTER, [], [], None, None, lineno=loop.lineno)
            loop.iter.set_environment(self)
        return template

    def concat(self, parts: Iterable[str]) -> str:
        """Joins a render's output, or a macro's or block's, piece by piece within the budget."""
        budget, num_chars, kept = current_budget(), 0, []
        for part in parts:
            num_chars += len(part)
            budget.check_size(num_chars, "the output")
            budget.tick()
            kept.append(part)
        return "".join(kept)

    def join_concat(self, eval_ctx, parts: tuple) -> str:
        """`a ~ b ~ ...`: Jinja's join, once the parts' text fits."""
        budget = current_budget()
        budget.check_size(sum(weight(part, budget.max_chars) for part in parts), "a string joined with ~")
        return markup_join(parts) if eval_ctx.autoescape else str_join(parts)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        if operator == "*":
            _check_product(budget, left, right)
        elif operator == "+" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
            budget.check_size(len(left) + len(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_format(budget, left, right, "%")
        elif operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            _check_int_bits(right * left.bit_length())
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        budget = current_budget()
        budget.tick()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's loop(items)
            args = (_counted(budget, args[0]), *args[1:])
        args = _check_method_call(budget, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        budget.check_length(result, "a call's result")
        return result


@pass_context
def _checked_output(context, value: Any) -> Any:
    """`finalize`: what `{{ value }}` prints must fit before `str()` makes it."""
    if not isinstance(value, str):
        current_budget().check_weight(value, "an output")
    return value


@pass_context
def _counted_loop(context, items: Iterable) -> Iterable:
    return _counted(current_budget(), items)


def _counted(budget: RenderBudget, items: Iterable) -> Iterable:
    for item in items:
        budget.tick()
        yield item


def _bounded_filter(name: str, func: Callable) -> Callable:
    """`func` with a tick, the size checks for filter `name`, and its result's length checked.

    The wrapper takes the context (so Jinja never runs it at compile time, outside any budget) and
    passes on what `func` asks for (context, eval context or environment)."""
    passes = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    precheck = _FILTER_CHECKS.get(name)
    makes_text = name in _TEXT_FILTERS

    @pass_context
    def bounded(context, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.tick()
        if makes_text and not isinstance(value, str):
            budget.check_weight(value, f"the text of |{name}")
        if precheck is not None:
            precheck(budget, value, *args, **kwargs)
        leading = {"context": (context,), "eval_context": (context.eval_ctx,),
                   "environment": (context.environment,)}.get(passes, ())
        result = func(*leading, value, *args, **kwargs)
        budget.check_length(result, f"the result of |{name}")
        return result

    return bounded


def _check_product(budget: RenderBudget, left: Any, right: Any) -> None:
    if _is_int(left) and _is_int(right):
        _check_int_bits(left.bit_length() + right.bit_length())
        return
    sequence, count = (left, right) if _is_int(right) else (right, left)
    if isinstance(sequence, (str, bytes, list, tuple)) and _is_int(count):
        budget.check_size(len(sequence) * max(count, 0), "a repetition")


def _check_int_bits(num_bits: int) -> None:
    if num_bits > MAX_INT_BITS:
        raise TemplateLimitError(
            f"the chat template exceeded its size limit: a number of about {num_bits} bits, over {MAX_INT_BITS}"
        )


def _check_format(budget: RenderBudget, template: str, values: Any, marker: str) -> None:
    """`template % values`, `template.format(*values)`: no width or precision past the limit, and each
    field at most the largest value's text."""
    if isinstance(values, Mapping):
        values = list(values.values())
    elif not isinstance(values, (tuple, list)):
        values = [values]
    if marker == "%":
        specs = [" ".join(field) for field in _PERCENT_FIELD.findall(template)]
    else:
        specs = _BRACE_SPEC.findall(template)
    numbers = [min(int(run[:13]), 10**12) for spec in specs for run in re.findall(r"\d+", spec)]
    if any("*" in spec or "{" in spec for spec in specs):  # widths taken from the values
        numbers += [v for v in values if _is_int(v)]
    budget.check_size(max(numbers, default=0), "a formatted field")
    largest = max((weight(v, budget.max_chars) for v in values), default=0)
    budget.check_size(len(template) + template.count(marker) * largest, "a formatted string")


def _check_method_call(budget: RenderBudget, func: Any, args: tuple, kwargs: dict) -> tuple:
    """Checks the size of what a str or bytes method (or int.to_bytes) is about to make; returns the
    arguments to call it with (`join`'s items as a list, counted once)."""
    method = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
    receiver, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if _is_int(receiver) and name == "to_bytes" and args and _is_int(args[0]):
        budget.check_size(args[0], "int.to_bytes")
    if not isinstance(receiver, (str, bytes)):
        return args
    size = len(receiver)
    if name in ("center", "ljust", "rjust", "zfill") and args and _is_int(args[0]):
        size = max(size, args[0])
    elif name == "expandtabs":
        tab_size = args[0] if args else kwargs.get("tabsize", 8)
        size += receiver.count("\t" if isinstance(receiver, str) else b"\t") * max(tab_size, 0)
    elif name == "replace" and len(args) >= 2:
        size = _replaced_size(receiver, args[0], args[1], args[2] if len(args) > 2 else -1)
    elif name == "join" and args:
        items = list(args[0])
        args = (items, *args[1:])
        size = sum(len(i) for i in items if isinstance(i, (str, bytes))) + size * max(len(items) - 1, 0)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        size *= max(longest, 1)
    elif name in ("format", "format_map") and isinstance(receiver, str):
        _check_format(budget, receiver, (*args, *kwargs.values()) if name == "format" else args[0], "{")
    budget.check_size(size, f"the result of .{name}()")
    return args


def _replaced_size(text: Any, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(old, type(text)) and isinstance(new, type(text)) and _is_int(count)):
        return len(text)
    occurrences = len(text) + 1 if not old else text.count(old)
    if count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * max(len(new) - len(old), 0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Filters whose result can be far larger than their input, checked from their arguments before
# they run; each takes the budget, then the filter's own arguments.
def _center(budget, value, width=80):
    budget.check_size(width if _is_int(width) else 0, "the result of |center")


def _indent(budget, text, width=4, first=False, blank=False):
    text = str(text)
    per_line = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    budget.check_size(len(text) + (text.count("\n") + 1) * per_line, "the result of |indent")


def _replace(budget, text, old, new, count=None):
    text = str(text)
    budget.check_size(_replaced_size(text, str(old), str(new), -1 if count is None else count),
                      "the result of |replace")


def _join(budget, items, separator="", attribute=None):
    if not isinstance(items, (str, list, tuple)):
        items = list(items)
    separators = len(str(separator)) * max(len(items) - 1, 0)
    budget.check_size(separators + sum(weight(i, budget.max_chars) for i in items), "the result of |join")


def _wordwrap(budget, text, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    text = str(text)
    budget.check_size(len(text) + (len(text) + 1) * len(wrapstring or "\n"), "the result of |wordwrap")


def _batch(budget, items, linecount, fill_with=None):
    budget.check_size(linecount if _is_int(linecount) else 0, "a batch of |batch")


def _slice(budget, items, slices, fill_with=None):
    if _is_int(slices) and slices > MAX_RANGE:
        raise TemplateLimitError(f"the chat template exceeded its size limit: |slice({slices}), over {MAX_RANGE}")


def _format(budget, template, *args, **kwargs):
    _check_format(budget, str(template), kwargs or args, "%")


def _sum(budget, items, attribute=None, start=0):
    if attribute is None and isinstance(items, (list, tuple)):
        lengths = [len(i) for i in items if isinstance(i, (str, bytes, list, tuple))]
        budget.check_size(sum(lengths) + (len(start) if isinstance(start, (list, tuple)) else 0), "|sum")


def _tojson(budget, value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    size = len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0
    if size > _MAX_JSON_INDENT:
        raise TemplateLimitError(f"the chat template asked |tojson for an indent of {size}; at most "
                                 f"{_MAX_JSON_INDENT} is allowed")


def _urlize(budget, text, trim_url_limit=None, nofollow=False, target=None, rel=None, extra_schemes=None):
    text = str(text)
    budget.check_size(len(text) * (1 + len(target or "") + len(rel or "")), "the result of |urlize")


_FILTER_CHECKS: dict[str, Callable] = {
    "center": _center, "indent": _indent, "replace": _replace, "join": _join, "wordwrap": _wordwrap,
    "batch": _batch, "slice": _slice, "format": _format, "sum": _sum, "tojson": _tojson, "urlize": _urlize,
}
