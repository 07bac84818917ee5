"""Chat templates found and rendered the way transformers does it, with jinja2 alone.

A checkpoint's templates come from `chat_template.jinja` and `additional_chat_templates/*.jinja`
when those files exist, else from `tokenizer_config.json`'s `chat_template` (a string, or a list of
`{"name", "template"}`). The one used by default is the one named "default"; a request with tools
gets the one named "tool_use" where there is one, as transformers picks it. Rendering uses the
same environment as transformers' `apply_chat_template` (Jinja's immutable sandbox, `trim_blocks`,
`lstrip_blocks`, loop controls, the `{% generation %}` tag, `raise_exception`, `strftime_now`, a
`tojson` that does not escape HTML, and the special tokens (`bos_token`, `eos_token`, ...) as
variables), bounded in time and size (bounded_sandbox.py, template_budget.py).
"""

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from services.common.errors import InvalidRequestError
from services.tokenizer.bounded_sandbox import BoundedSandboxedEnvironment
from services.tokenizer.template_budget import RenderBudget, TemplateLimits, weight

DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"  # the one transformers renders a request with tools by, where it exists
# Variables the renderer sets itself; template kwargs may not override them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt"})
DEFAULT_TEMPLATE_LIMITS = TemplateLimits()
# strftime_now's format: plenty for a date, too short to make a large string.
_MAX_STRFTIME_FORMAT_CHARS = 256


def load_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The checkpoint's templates by name; files beside the config take priority over the config."""
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates[DEFAULT_TEMPLATE_NAME] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, str):
        return {DEFAULT_TEMPLATE_NAME: configured}
    if isinstance(configured, list):
        return {entry["name"]: entry["template"] for entry in configured}
    return {}


def server_chat_template(value: str) -> str:
    """``--chat-template``, as vLLM reads it: a path to a template file, or the template itself (a value
    with Jinja's ``{`` or a line break); compiled here, so a broken one stops the server at start."""
    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif any(char in value for char in "{}\n"):
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a template (a template has {{ or }})")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"--chat-template does not compile: {error} (line {error.lineno})") from None
    return template


CONTINUATION_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for where the final message ends


def tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with ``CONTINUATION_TAG`` after the final message's text (its last text part), as
    transformers marks a message to continue (``continue_final_message``); the caller's are not changed."""
    if not messages or not isinstance(messages[-1].get("content"), str | list):
        raise InvalidRequestError("continue_final_message needs a final message with content to continue")
    final = dict(messages[-1])
    if isinstance(final["content"], str):
        final["content"] += CONTINUATION_TAG
    else:
        parts = [dict(part) for part in final["content"]]
        text_part = next((part for part in reversed(parts) if "text" in part), None)
        if text_part is None:
            raise InvalidRequestError("continue_final_message needs text in the final message to continue")
        text_part["text"] += CONTINUATION_TAG
        final["content"] = parts
    return [*messages[:-1], final]


def cut_at_continuation_tag(text: str) -> str:
    """The rendered chat up to the tag: the final message left open (its trailing spaces kept where the
    template kept the tag's own, trimmed where it trimmed them), as transformers cuts it."""
    at = text.rfind(CONTINUATION_TAG.strip())
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not render the final message's "
                                  "content, so it cannot be continued")
    return text[:at] if text[at:at + len(CONTINUATION_TAG)] == CONTINUATION_TAG else text[:at].rstrip()


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
    limits: TemplateLimits = DEFAULT_TEMPLATE_LIMITS,
) -> str:
    """Renders `messages` with the template source `template`, within `limits`.

    `variables` are passed to the template as transformers passes the special tokens and the
    caller's template kwargs (`tools`, `documents` and any other name). Raises InvalidRequestError
    for malformed messages, a template that does not compile or fails while rendering (including its
    own `raise_exception`), variables that would replace `messages` or `add_generation_prompt`, and
    (TemplateLimitError) a render that would pass its time or size limit. Holds the GIL while it
    renders, at most about `limits.timeout_s` (plus compiling the template, once per source).
    """
    _check_messages(messages)
    reserved = RESERVED_VARIABLES & variables.keys()
    if reserved:
        raise InvalidRequestError(f"template kwargs may not set {sorted(reserved)}; they come from the request")
    context = {"tools": None, "documents": None, **variables}
    budget = RenderBudget(limits, num_input_chars=weight(messages) + weight(context))
    try:
        compiled = _compile(template)
        with budget.spending():
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except InvalidRequestError:
        raise
    except RecursionError as exc:
        raise InvalidRequestError("the chat template nests too deeply (macros, recursive loops or expressions)") from exc
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template error: {exc}") from exc
    except (TypeError, ValueError, LookupError, ArithmeticError) as exc:
        raise InvalidRequestError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from exc


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise InvalidRequestError("messages must hold at least one message")
    for index, message in enumerate(messages):
        if not message.get("role"):
            raise InvalidRequestError(f"messages[{index}] has no role")


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@functools.cache
def _environment() -> BoundedSandboxedEnvironment:
    return BoundedSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        filters={"tojson": _tojson},
        globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now, "dict": _TemplateDict(),
                 "namespace": _TemplateNamespace},
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    if len(fmt) > _MAX_STRFTIME_FORMAT_CHARS:
        raise InvalidRequestError(f"strftime_now's format has {len(fmt)} characters; at most "
                                  f"{_MAX_STRFTIME_FORMAT_CHARS} are allowed")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged (it marks assistant text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without handing the template the dict type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja namespace that refuses underscore-prefixed attributes, as transformers' does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")
