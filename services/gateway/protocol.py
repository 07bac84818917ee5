"""OpenAI request bodies as pydantic models: types only. Ranges and cross-field rules live in
``validation.py`` so their messages can say what to do; unknown fields are ignored, as vLLM does.

Fields past OpenAI's are vLLM's "extra body" parameters with vLLM's names and defaults.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(_Body):
    """Any content part; only text parts can be served, the rest are rejected by validation."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class SamplingFields(_Body):
    """What chat and completions share: the engine's sampling and stopping parameters."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# Token ids are StrictInt so that a list of strings is never read as ids.
Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: StrictBool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's completions default to adding special tokens (BOS) to a text prompt.
    add_special_tokens: bool = True
