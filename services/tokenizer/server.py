"""The Tokenizer gRPC servicer: protobuf in, `CheckpointTokenizer` calls, protobuf out.

Errors are raised, never caught here: `services.common.grpc_server` maps them to status codes.
Detokenize answers each request message with one response (its delta may be empty while a
character is unfinished); when the client closes its side, one last response carries whatever
text was still held back. Decoder hands out the checkpoint's decoding (`TokenDecoder`), with
which a caller such as the gateway detokenizes in-process exactly as Detokenize does.
"""

import asyncio
import concurrent.futures
import functools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.grpc_server import GrpcServer
from services.common.pb import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.tls import TlsFiles
from services.tokenizer.chat_template import DEFAULT_TEMPLATE_LIMITS
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.template_budget import MAX_REQUEST_TEMPLATE_CHARS, TemplateLimits

log = logging.getLogger(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Encoding, chat rendering and decoding run on a pool of worker threads, never on the event
    loop: a 4 MB prompt or a slow template must not hold up other requests, their streams or health
    (`tokenizers` releases the GIL; a template render is bounded by its `TemplateLimits`)."""

    def __init__(self, tokenizer: CheckpointTokenizer, trust_request_chat_template: bool = False,
                 workers: int = 4, limits: TemplateLimits = DEFAULT_TEMPLATE_LIMITS,
                 metrics: TokenizerMetrics | None = None) -> None:
        self._tokenizer = tokenizer
        self.metrics = metrics or TokenizerMetrics()
        self._trust_request_chat_template = trust_request_chat_template
        self._limits = limits
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    async def Encode(self, request, context) -> tokenizer_pb2.EncodeResponse:
        with self.metrics.answering("Encode"):
            ids = await self._run(self._tokenizer.encode, request.text, request.add_special_tokens)
        self.metrics.tokens.labels("encoded").inc(len(ids))
        return tokenizer_pb2.EncodeResponse(token_ids=ids)

    async def EncodeChat(self, request, context) -> tokenizer_pb2.EncodeChatResponse:
        with self.metrics.answering("EncodeChat"):
            response = await self._encode_chat(request)
        self.metrics.tokens.labels("encoded").inc(len(response.token_ids))
        return response

    async def _encode_chat(self, request) -> tokenizer_pb2.EncodeChatResponse:
        own_template = not request.chat_template or request.chat_template in self._tokenizer.chat_templates
        if not own_template and self._trust_request_chat_template \
                and len(request.chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise InvalidRequestError(f"chat_template has {len(request.chat_template)} characters; at most "
                                      f"{MAX_REQUEST_TEMPLATE_CHARS} are allowed")
        if not own_template and not self._trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template in a request is disabled: a template is code the server runs. Use one of the "
                f"model's own templates ({', '.join(sorted(self._tokenizer.chat_templates)) or 'none'}), or start "
                "the tokenizer with --trust-request-chat-template")
        messages = [_message_dict(message) for message in request.messages]
        ids, text = await self._run(functools.partial(
            self._tokenizer.encode_chat, messages, request.add_generation_prompt, request.chat_template,
            _template_kwargs(request.template_kwargs_json), limits=self._limits,
            continue_final_message=request.continue_final_message))
        return tokenizer_pb2.EncodeChatResponse(token_ids=ids, prompt_text=text)

    async def Decode(self, request, context) -> tokenizer_pb2.DecodeResponse:
        with self.metrics.answering("Decode"):
            text = await self._run(self._tokenizer.decode, list(request.token_ids), request.skip_special_tokens)
        self.metrics.tokens.labels("decoded").inc(len(request.token_ids))
        return tokenizer_pb2.DecodeResponse(text=text)

    async def TokenStrings(self, request, context) -> tokenizer_pb2.TokenStringsResponse:
        with self.metrics.answering("TokenStrings"):
            tokens = await self._run(self._tokenizer.token_strings, list(request.token_ids))
        return tokenizer_pb2.TokenStringsResponse(tokens=tokens)

    async def Detokenize(self, request_iterator, context) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        self.metrics.detokenize_streams.inc()
        decoded = self.metrics.tokens.labels("decoded")
        try:
            with self.metrics.answering("Detokenize", timed=False):
                detokenizer = None
                async for request in request_iterator:
                    if detokenizer is None:
                        prefix = list(request.prefix_token_ids)
                        self._tokenizer.check_ids(prefix)
                        detokenizer = self._tokenizer.decoder.detokenizer(request.skip_special_tokens, prefix)
                    ids = list(request.token_ids)
                    self._tokenizer.check_ids(ids)
                    delta = detokenizer.step(ids)
                    decoded.inc(len(ids))
                    yield tokenizer_pb2.DetokenizeResponse(text_delta=delta,
                                                           num_token_ids=detokenizer.num_emitted_ids)
                if detokenizer is not None:
                    rest = detokenizer.flush()
                    if rest:
                        yield tokenizer_pb2.DetokenizeResponse(text_delta=rest,
                                                               num_token_ids=detokenizer.num_emitted_ids)
        finally:
            self.metrics.detokenize_streams.dec()

    async def Decoder(self, request, context) -> tokenizer_pb2.DecoderResponse:
        with self.metrics.answering("Decoder"):
            return await self._run(self._tokenizer.decoder.to_proto)

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
    if message.tool_calls:
        result["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
    return result


def _tool_call(call: tokenizer_pb2.ToolCall) -> dict[str, Any]:
    """OpenAI sends each call's arguments as a JSON string; chat templates (Llama 3.1, Qwen2.5, Hermes)
    expect the object, as transformers' examples pass it, so a string that holds JSON is parsed (as
    vLLM does). Arguments that are not JSON stay the string they were."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return {"id": call.id, "type": call.type or "function",
            "function": {"name": call.function.name, "arguments": arguments}}


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


# A prompt of the gateway's largest body (8 MiB) must fit: gRPC's default 4 MiB would refuse it as
# RESOURCE_EXHAUSTED, which clients read as "retry later".
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


async def serve(tokenizer: CheckpointTokenizer, host: str, port: int, servicer: TokenizerServicer | None = None,
                tls: TlsFiles | None = None, shutdown_timeout_s: float = 60.0) -> None:
    """Serves `tokenizer` on host:port until SIGTERM/SIGINT; then its open Detokenize streams get up
    to ``shutdown_timeout_s`` to finish (a draining gateway's streams)."""
    server = GrpcServer([SERVICE_NAME], grace_s=shutdown_timeout_s, options=GRPC_OPTIONS)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer or TokenizerServicer(tokenizer), server.server)
    bound_port = server.add_port(f"{host}:{port}", tls)
    await server.start()
    await server.set_serving()
    log.info("tokenizer serving %s on %s:%d", tokenizer.model, host, bound_port)
    await server.wait_for_termination()
