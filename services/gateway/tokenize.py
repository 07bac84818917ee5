"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, through the
tokenizer service, so that a client counts a prompt's tokens (or a chat's, rendered by the same
template as /v1/chat/completions) as the engine will see them. Behind ``--api-key`` like /v1.

/tokenize answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``, the
vocabulary's strings, only with ``return_token_strs``); /detokenize ``{"prompt"}``.
"""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway import errors
from services.gateway.chat import messages_proto
from services.gateway.protocol import ERROR_RESPONSES, DetokenizeRequest, TokenizeRequest
from services.gateway.request_body import JsonBodyRoute
from services.gateway.serving import gateway_state
from services.gateway.tools import check_tool_definitions
from services.gateway.validation import check_continuation, check_messages, check_model, check_token_ids

router = APIRouter(route_class=JsonBodyRoute)  # bodies read by request_body.py


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    upstream = gateway_state(request).upstream
    facts = await upstream.facts()
    check_model(body.model, facts)
    if (body.prompt is None) == (body.messages is None):
        raise errors.bad_request("Give either prompt (a text) or messages (a chat), not both or neither.",
                                 param="prompt")
    if body.prompt is not None:
        ids = await upstream.encode(body.prompt, body.add_special_tokens is not False)
    else:
        check_messages(body.messages)
        check_continuation(body.add_generation_prompt, body.continue_final_message)
        check_tool_definitions(body.tools)
        if body.add_special_tokens:
            raise errors.bad_request("add_special_tokens applies to a prompt: a chat's special tokens are its "
                                     "template's.", param="add_special_tokens")
        # as /v1/chat/completions passes them: the tools, then chat_template_kwargs over them
        template_kwargs = {**({"tools": body.tools} if body.tools else {}), **(body.chat_template_kwargs or {})}
        ids = await upstream.encode_chat(await messages_proto(body.messages), body.add_generation_prompt,
                                         body.chat_template, template_kwargs, body.continue_final_message)
    token_strs = await upstream.token_strings(ids) if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": facts.max_model_len, "tokens": ids,
                         "token_strs": token_strs})


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    upstream = gateway_state(request).upstream
    check_model(body.model, await upstream.facts())
    check_token_ids(body.tokens, "tokens")
    return JSONResponse({"prompt": await upstream.decode(body.tokens, skip_special_tokens=False)})
