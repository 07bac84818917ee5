"""A reasoning model's thinking, told apart from its answer (vLLM's ``--reasoning-parser``).

DeepSeek-R1 and the models trained on its traces (its Qwen2 and Llama distills, QwQ, OpenThinker)
think between ``<think>`` and ``</think>``, then answer. Their chat templates open the ``<think>`` in
the prompt, so the output is thinking up to ``</think>`` (a ``<think>`` the model writes itself is
dropped) and the answer after it; an output cut off before ``</think>`` is all thinking, as vLLM's
``deepseek_r1`` parser reads it. A chat message then carries the thinking as ``reasoning`` and as
``reasoning_content`` (vLLM's present and former name; DeepSeek's API and most clients read the
latter) and the answer as ``content``, where tool calls are looked for; a structured-output
constraint applies to the answer alone (the engine starts it after the end tag's tokens).
"""

import logging
from dataclasses import dataclass

from services.common.pb import engine_pb2
from services.gateway import errors
from services.gateway.held_back import held_back_length

log = logging.getLogger(__name__)

REASONING_PARSERS = ("deepseek_r1",)


@dataclass(frozen=True)
class ReasoningTags:
    start: str = "<think>"
    end: str = "</think>"


TAGS = {"deepseek_r1": ReasoningTags()}


class ReasoningParser:
    """``--reasoning-parser``: its tags, and the end tag's token id in the served vocabulary (looked up
    once). Each tag must be one token of the vocabulary, as vLLM requires: a model that was not trained
    to think between them never writes them, and its every answer would read as thinking."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tags = TAGS[name]
        self._end_token_ids: list[int] | None = None

    async def end_token_ids(self, upstream) -> list[int]:
        if self._end_token_ids is None:
            ids = {tag: await upstream.encode(tag, add_special_tokens=False) for tag in (self.tags.start, self.tags.end)}
            split = {tag: len(found) for tag, found in ids.items() if len(found) != 1}
            if split:
                message = (f"--reasoning-parser {self.name} needs {self.tags.start} and {self.tags.end} as tokens of "
                           f"the model's vocabulary; this tokenizer makes " + ", ".join(
                               f"{tag} {count} tokens" for tag, count in split.items()) + ": serve it without the flag")
                log.error("%s", message)
                raise errors.OpenAIError(message, 500)
            self._end_token_ids = ids[self.tags.end]
        return self._end_token_ids

    async def prepare(self, upstream, params) -> None:
        """A chat request's ``params`` (validation.GenerationParams) for a thinking model: usage counts
        the tokens before the end tag as reasoning_tokens, and a structured-output constraint binds
        the answer only (the engine starts it once the output holds the end tag's token)."""
        end_token_ids = await self.end_token_ids(upstream)
        params.reasoning_end_token_id = end_token_ids[0]
        if params.constraint is not None:
            proto = engine_pb2.StructuredOutput()
            proto.CopyFrom(params.constraint.proto)
            proto.starts_after[:] = end_token_ids
            params.constraint = type(params.constraint)(params.constraint.param, proto)


def split_reasoning(text: str, tags: ReasoningTags) -> tuple[str, str | None]:
    """A whole output as (reasoning, content); content is None when nothing follows the end tag, or
    when there is none (the output was cut off while thinking)."""
    before, start, after = text.partition(tags.start)
    text = after if start else before
    reasoning, end, content = text.partition(tags.end)
    return reasoning, (content or None) if end else None


class ReasoningStream:
    """One streamed choice: ``feed(delta)`` returns the delta's (reasoning, content). Text that may
    be the start of a tag is held back until the next delta says whether it is one (``finish``
    returns what is held when the output ends)."""

    def __init__(self, tags: ReasoningTags) -> None:
        self._tags = tags
        self._thinking = True
        self._seen_start = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if not self._thinking:
            return "", text
        if not self._seen_start and self._tags.start in text:
            self._seen_start = True
            before, _, after = text.partition(self._tags.start)
            text = before + after
        reasoning, end, content = text.partition(self._tags.end)
        if end:
            self._thinking = False
            return reasoning, content
        markers = (self._tags.end,) if self._seen_start else (self._tags.start, self._tags.end)
        cut = len(text) - held_back_length(text, markers)
        self._held = text[cut:]
        return text[:cut], ""

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._thinking else ("", held)

