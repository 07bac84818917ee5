"""OpenAI request bodies as pydantic models: types only. Ranges and cross-field rules live in
``validation.py`` so their messages can say what to do; unknown fields are ignored, as vLLM does.
Booleans are strict, as OpenAI's are: ``"stream": "yes"`` or ``1`` is a 400, not true.

Fields past OpenAI's are vLLM's "extra body" parameters with vLLM's names and defaults.
"""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = ""  # OpenAI's: the arguments' JSON text; an object is taken too


class ToolCall(_Body):
    """One call of an assistant turn, as a client sends the conversation back."""
    id: StrictStr = ""
    type: StrictStr = "function"
    function: FunctionCall


class StreamOptions(_Body):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``. ``schema`` is taken as any JSON so that a schema that is not an
    object gets validation's message rather than pydantic's."""
    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text``, ``json_object``, or ``json_schema`` with ``json_schema``."""
    type: StrictStr
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Body):
    """vLLM's ``structured_outputs`` extra body: at most one constraint (``json`` a schema, as an
    object or its JSON text). vLLM's options that tune whitespace are accepted and ignored (the
    engine writes JSON without free whitespace)."""
    json_: Any = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: Any = None  # vLLM's; not supported, refused by validation


class ContentPart(_Body):
    """Any content part; only text parts can be served, the rest are rejected by validation."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class SamplingFields(_Body):
    """What chat and completions share: the engine's sampling and stopping parameters."""

    model: str | None = None
    stream: StrictBool = False
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
    response_format: ResponseFormat | None = None
    # vLLM extras
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Any = None  # vLLM's older names for the structured_outputs fields
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    cache_salt: str | None = None
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs in the response, as vLLM shapes them
    return_tokens_as_token_ids: StrictBool = False  # logprobs name each token "token_id:<id>", as vLLM's


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: StrictBool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM extras
    add_generation_prompt: StrictBool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: StrictBool = True  # with --reasoning-parser: false drops the thinking from the answer
    continue_final_message: StrictBool = False  # the final (assistant) message is continued, not closed
    echo: StrictBool = False  # the answer starts with the last message, where that is the assistant's


class ResponseInputContent(_Body):
    """A part of a Responses input message: ``input_text`` (or ``output_text``, an earlier answer) is
    served; any other part (images, files) is refused by validation."""
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ResponseInputItem(_Body):
    """One item of a Responses ``input`` list: a message (``type`` "message" or absent), an earlier
    ``function_call`` of the model, or a ``function_call_output`` answering one. Other item types
    (reasoning, built-in tools' calls) are refused by validation."""
    model_config = ConfigDict(extra="allow")
    type: StrictStr = "message"
    role: StrictStr | None = None
    content: StrictStr | list[ResponseInputContent] | None = None
    call_id: StrictStr | None = None  # function_call, function_call_output
    name: StrictStr | None = None  # function_call
    arguments: StrictStr | None = None  # function_call: the arguments' JSON text
    output: StrictStr | list[ResponseInputContent] | None = None  # function_call_output


class ResponseTextFormat(JsonSchemaFormat):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with chat's ``json_schema`` fields
    (``name``, ``schema``, ``strict``) beside its ``type``."""
    type: StrictStr = "text"


class ResponseText(_Body):
    format: ResponseTextFormat | None = None


class ResponsesRequest(_Body):
    """OpenAI's ``POST /v1/responses`` (text in, text out; nothing is stored server-side)."""
    model: str | None = None
    input: StrictStr | list[ResponseInputItem]
    instructions: StrictStr | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    text: ResponseText | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize``: a text ``prompt``, or chat ``messages`` rendered by the chat template as
    /v1/chat/completions renders them (``tools`` and ``chat_template_kwargs`` reach the template the same
    way). ``add_special_tokens`` is for a prompt (default true, as completions): a chat's special tokens
    are its template's."""
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize``: token ids to text, special tokens included."""
    model: str | None = None
    tokens: list[StrictInt]


def _prompt_shape(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value and isinstance(value[0], str):
        return "texts"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "id_lists"
    return "ids"


# Token ids are StrictInt so that a list of strings is never read as ids. The shape (the first
# item's type) picks the one type to validate against: a plain union would try each, and a list of
# 2M ids would first fail as 2M strings, one error each (1.1 s with the event loop held; 34 ms so).
Prompt = Annotated[Annotated[StrictStr, Tag("text")] | Annotated[list[StrictStr], Tag("texts")]
                   | Annotated[list[StrictInt], Tag("ids")] | Annotated[list[list[StrictInt]], Tag("id_lists")],
                   Discriminator(_prompt_shape)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: StrictBool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's completions default to adding special tokens (BOS) to a text prompt.
    add_special_tokens: StrictBool = True


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every error's body (``errors.py``); in /openapi.json as the routes' 4XX and 5XX."""
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "The request can never succeed as sent (not retried)."},
    "5XX": {"model": ErrorResponse, "description": "Overloaded or an upstream is down (503 with Retry-After)."},
}
