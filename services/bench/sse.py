"""Reading an OpenAI streaming response: SSE events' data in (`http_stream`), token timings out.

How tokens are counted per chunk, best source first:
1. `usage.completion_tokens` on a chunk that has choices (vLLM's `continuous_usage_stats`): the
   increase since the previous chunk is exact, so a chunk carrying k tokens counts k.
2. `logprobs` on the chunk (`logprobs.tokens` for completions, `logprobs.content` for chat).
3. Otherwise one token per chunk that shows one: with text, or with empty text before the finish (vLLM
   sends a chunk per step even where its tokens show no text yet: a special token, half a UTF-8
   character), or the finishing chunk of a stream that showed none before it (one EOS token). Chat's
   role chunk shows none.
The final usage-only chunk (`choices: []`, from `include_usage`) counts no tokens; its
`completion_tokens` is the request's output length when present.

A chunk of k tokens after a gap g adds k inter-token gaps of g/k; when the first chunk carries k
tokens (a server holding back half a UTF-8 character), its k-1 extra tokens add gaps of 0. So with
exact counts a request has output_tokens - 1 gaps summing to its last token time minus TTFT.
"""

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Chunk:
    """What one SSE data object says about generation."""

    has_choices: bool = False
    text: str = ""
    empty_token: bool = False  # a chunk of empty text that still carries a token (see the module's 3.)
    finished: bool = False  # it has a finish_reason
    num_logprob_tokens: int | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None


def parse_chunk(data: dict[str, Any]) -> Chunk:
    """Interpret one chunk of `/v1/completions` or `/v1/chat/completions` streaming output."""
    chunk = Chunk(usage=data.get("usage") or None)
    if "error" in data:
        err = data["error"]
        chunk.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
        return chunk
    choices = data.get("choices") or []
    if not choices:
        return chunk
    chunk.has_choices = True
    choice = choices[0]
    chunk.finished = choice.get("finish_reason") is not None
    if "delta" in choice:  # chat
        delta = choice.get("delta") or {}
        chunk.text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        chunk.empty_token = not chunk.finished and "role" not in delta and (
            "content" in delta or bool(delta.get("tool_calls")))
        logprobs = choice.get("logprobs") or {}
        if logprobs.get("content") is not None:
            chunk.num_logprob_tokens = len(logprobs["content"])
    else:  # completions
        chunk.text = choice.get("text") or ""
        chunk.empty_token = not chunk.finished
        logprobs = choice.get("logprobs") or {}
        if logprobs.get("tokens") is not None:
            chunk.num_logprob_tokens = len(logprobs["tokens"])
    return chunk


@dataclass
class TokenTimeline:
    """Accumulates the timing of one streamed request. `start` and every `t` are one clock (s)."""

    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    num_counted: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None
    last_token_time: float | None = None
    _usage_completion: int = 0

    def on_data(self, data: str, t: float) -> bool:
        """Handle one SSE data payload received at `t`; returns False at `[DONE]`."""
        if data.strip() == "[DONE]":
            return False
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad SSE data: {data[:80]!r}"
            return False
        self.on_chunk(parse_chunk(obj), t)
        return self.error is None

    def on_chunk(self, chunk: Chunk, t: float) -> None:
        if chunk.error is not None:
            self.error = chunk.error
            return
        if chunk.usage:
            self.usage = chunk.usage
        if not chunk.has_choices:
            return
        num_tokens = self._tokens_in(chunk)
        if num_tokens <= 0:
            return
        if self.ttft is None:
            self.ttft = t - self.start
            self.itl.extend([0.0] * (num_tokens - 1))  # delivered with the first: no wait between them
        else:
            gap = t - self.last_token_time
            self.itl.extend([gap / num_tokens] * num_tokens)
        self.last_token_time = t
        self.num_counted += num_tokens

    def _tokens_in(self, chunk: Chunk) -> int:
        completion = (chunk.usage or {}).get("completion_tokens")
        if isinstance(completion, int):
            num_tokens, self._usage_completion = completion - self._usage_completion, completion
            return num_tokens
        if chunk.num_logprob_tokens is not None:
            return chunk.num_logprob_tokens
        return 1 if chunk.text or chunk.empty_token or (chunk.finished and self.ttft is None) else 0

    @property
    def output_tokens(self) -> int:
        """The server's count when it sent usage, else the tokens counted from chunks."""
        completion = (self.usage or {}).get("completion_tokens")
        return completion if isinstance(completion, int) else self.num_counted

    @property
    def prompt_tokens(self) -> int | None:
        prompt = (self.usage or {}).get("prompt_tokens")
        return prompt if isinstance(prompt, int) else None

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the server found in its prefix cache (OpenAI's
        ``usage.prompt_tokens_details.cached_tokens``), when it said."""
        details = (self.usage or {}).get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cached if isinstance(cached, int) else None
