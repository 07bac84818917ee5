"""The Tokenizer gRPC servicer: protobuf in, `CheckpointTokenizer` calls, protobuf out.

Errors are raised, never caught here: `services.common.grpc_server` maps them to status codes.
Detokenize answers each request message with one response (its delta may be empty while a
character is unfinished); when the client closes its side, one last response carries whatever
text was still held back.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.grpc_server import GrpcServer
from services.common.pb import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, tokenizer: CheckpointTokenizer) -> None:
        self._tokenizer = tokenizer

    async def Encode(self, request, context) -> tokenizer_pb2.EncodeResponse:
        ids = self._tokenizer.encode(request.text, request.add_special_tokens)
        return tokenizer_pb2.EncodeResponse(token_ids=ids)

    async def EncodeChat(self, request, context) -> tokenizer_pb2.EncodeChatResponse:
        messages = [_message_dict(message) for message in request.messages]
        ids, text = self._tokenizer.encode_chat(
            messages,
            request.add_generation_prompt,
            request.chat_template,
            _template_kwargs(request.template_kwargs_json),
        )
        return tokenizer_pb2.EncodeChatResponse(token_ids=ids, prompt_text=text)

    async def Decode(self, request, context) -> tokenizer_pb2.DecodeResponse:
        text = self._tokenizer.decode(list(request.token_ids), request.skip_special_tokens)
        return tokenizer_pb2.DecodeResponse(text=text)

    async def Detokenize(self, request_iterator, context) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        detokenizer = None
        async for request in request_iterator:
            if detokenizer is None:
                prefix = list(request.prefix_token_ids)
                detokenizer = self._tokenizer.detokenizer(request.skip_special_tokens, prefix)
            delta = detokenizer.step(list(request.token_ids))
            yield tokenizer_pb2.DetokenizeResponse(text_delta=delta, num_token_ids=detokenizer.num_emitted_ids)
        if detokenizer is not None:
            rest = detokenizer.flush()
            if rest:
                yield tokenizer_pb2.DetokenizeResponse(text_delta=rest, num_token_ids=detokenizer.num_emitted_ids)

    async def Info(self, request, context) -> tokenizer_pb2.TokenizerInfoResponse:
        tokenizer = self._tokenizer
        return tokenizer_pb2.TokenizerInfoResponse(
            vocab_size=tokenizer.vocab_size,
            eos_token_ids=tokenizer.eos_token_ids,
            bos_token_id=tokenizer.bos_token_id,
            max_model_len=tokenizer.max_model_len,
            has_chat_template=tokenizer.has_chat_template,
            model=tokenizer.model,
        )


def _message_dict(message: tokenizer_pb2.ChatMessage) -> dict[str, Any]:
    result = {"role": message.role, "content": message.content}
    if message.HasField("name"):
        result["name"] = message.name
    if message.HasField("tool_call_id"):
        result["tool_call_id"] = message.tool_call_id
    if message.tool_calls_json:
        result["tool_calls"] = _tool_calls(message.tool_calls_json)
    return result


def _tool_calls(tool_calls_json: str) -> list[dict[str, Any]]:
    """OpenAI sends each call's arguments as a JSON string; chat templates (Llama 3.1, Qwen2.5, Hermes)
    expect the object, as transformers' examples pass it, so a string that holds JSON is parsed (as
    vLLM does). Arguments that are not JSON stay the string they were."""
    try:
        calls = json.loads(tool_calls_json)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"tool_calls_json is not valid JSON: {exc}") from exc
    if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
        raise InvalidRequestError("tool_calls_json must be a JSON array of objects")
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
    return calls


def _template_kwargs(template_kwargs_json: str) -> dict[str, Any]:
    if not template_kwargs_json:
        return {}
    try:
        kwargs = json.loads(template_kwargs_json)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"template_kwargs_json is not valid JSON: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("template_kwargs_json must be a JSON object")
    return kwargs


async def serve(tokenizer: CheckpointTokenizer, host: str, port: int) -> None:
    """Serves `tokenizer` on host:port until SIGTERM/SIGINT."""
    server = GrpcServer([SERVICE_NAME])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(tokenizer), server.server)
    bound_port = server.add_port(f"{host}:{port}")
    await server.start()
    await server.set_serving()
    print(f"tokenizer serving {tokenizer.model} on {host}:{bound_port}", flush=True)
    await server.wait_for_termination()
