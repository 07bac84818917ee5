"""The OpenTelemetry GenAI semantic conventions on the gateway's root span, so a trace backend's
LLM views (and a search by ``gen_ai.response.id``) work on Strata's traces as on any model API's.

``request_attributes`` are set once the request is validated, ``response_attributes`` when it ends.
The stages the gateway itself goes through are events on the same span (``STAGE_*``): the first
token back from the engine, the first chunk carrying output sent to the client (a stream), and a stop
string that ended a choice.
"""

from services.gateway.validation import GenerationParams

PROVIDER = "strata"
STAGE_FIRST_TOKEN = "first_token"
STAGE_FIRST_CHUNK_SENT = "first_chunk_sent"
STAGE_STOP_STRING = "stop_string"
_SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
_INT64 = 1 << 63


def request_attributes(operation: str, model: str, response_id: str, params: GenerationParams) -> dict:
    """``operation`` is ``chat`` or ``text_completion``; ``model`` the served model's name."""
    attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
                  "gen_ai.request.model": model, "gen_ai.response.model": model, "gen_ai.response.id": response_id}
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    for name in _SAMPLING:
        if name in params.sampling:
            attributes[f"gen_ai.request.{name}"] = params.sampling[name]
    if params.seed is not None:  # OTLP integers are 64-bit signed; a seed may be any 64-bit unsigned
        attributes["gen_ai.request.seed"] = params.seed if params.seed < _INT64 else str(params.seed)
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    if params.n != 1:
        attributes["gen_ai.request.choice.count"] = params.n
    return attributes


def response_attributes(input_tokens: int, output_tokens: int, finish_reasons: list[str | None]) -> dict:
    """``finish_reasons`` by choice index (None: the choice did not finish)."""
    return {"gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": [reason for reason in finish_reasons if reason is not None]}
