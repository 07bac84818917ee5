"""The gateway's async gRPC clients to the tokenizer and the engine (or a router in front of
engines). Every unary call has a deadline; a failure becomes an ``OpenAIError`` (INVALID_ARGUMENT
-> 400, UNAVAILABLE -> 503, ...). Streaming calls are opened here and consumed by
``generation.py``, which owns their cancellation. Every call is a CLIENT span of the request's trace
and carries its trace context and request id in its metadata (`services.common.client_span`; not
channel interceptors: grpc.aio relays each message of an intercepted stream through an extra queue
and task, a cost paid per generated token).
"""

import asyncio
import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import client_span
from services.common.pb import engine_pb2, engine_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.shared_generate import SharedGenerate
from services.common.shared_stream import in_sampled_trace
from services.common.tls import TlsFiles, aio_channel
from services.common.token_decoder import TokenDecoder
from services.gateway import errors
from services.gateway.validation import ModelFacts

MAX_MESSAGE_BYTES = 64 << 20  # the tokenizer's and the engine's servers accept as much
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_ENGINE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name + "/"
_TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name + "/"


class Upstream:
    """Channels and stubs of one tokenizer and one engine; create inside the event loop."""

    def __init__(self, tokenizer_addr: str, engine_addr: str, served_model_name: str | None = None,
                 rpc_timeout_s: float = 30.0, generate_timeout_s: float = 3600.0, tls: TlsFiles | None = None,
                 served_model_aliases: tuple[str, ...] = ()) -> None:
        self._tokenizer_channel = aio_channel(tokenizer_addr, tls, options=_CHANNEL_OPTIONS)
        self._engine_channel = aio_channel(engine_addr, tls, options=_CHANNEL_OPTIONS)
        self._addresses = {"tokenizer": tokenizer_addr, "engine": engine_addr}
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._tokenizer_channel)
        self.engine = engine_pb2_grpc.EngineStub(self._engine_channel)
        self.rpc_timeout_s = rpc_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self._served_model_name = served_model_name
        self._served_model_aliases = served_model_aliases
        self._facts: ModelFacts | None = None
        self._fetching_facts = asyncio.Lock()
        self._decoder: TokenDecoder | None = None
        self._shared_generate = SharedGenerate(lambda: self.engine.GenerateMany(), "engine", generate_timeout_s)

    def generate(self, request: engine_pb2.GenerateRequest):
        """The engine's outputs for ``request``: on the shared GenerateMany stream when the engine
        answers it, the request is not traced and its id is not running there already (the engine
        refuses a second, on a stream of its own); else on a Generate stream of its own."""
        if (self._facts is not None and self._facts.generate_many and not in_sampled_trace()
                and not self._shared_generate.running(request.request_id)):
            return self._shared_generate.generate(request)
        return client_span.call(_ENGINE + "Generate", self._addresses["engine"], lambda metadata: self.engine.Generate(
            request, timeout=self.generate_timeout_s, metadata=metadata))

    async def close(self) -> None:
        self._shared_generate.close("the gateway is closing its upstream streams")
        await asyncio.gather(self._tokenizer_channel.close(), self._engine_channel.close())

    async def facts(self) -> ModelFacts:
        """The served model's facts, fetched once from the engine and the tokenizer, with the
        tokenizer's decoder (`decoder`)."""
        if self._facts is None:
            async with self._fetching_facts:
                if self._facts is None:
                    self._facts = await self._fetch_facts()
        return self._facts

    async def _fetch_facts(self) -> ModelFacts:
        engine_info, tokenizer_info, decoder = await asyncio.gather(
            self._unary("engine", "Info", engine_pb2.EngineInfoRequest(), 5.0),
            self._unary("tokenizer", "Info", tokenizer_pb2.TokenizerInfoRequest(), 5.0),
            self._unary("tokenizer", "Decoder", tokenizer_pb2.DecoderRequest()))
        self._decoder = await asyncio.to_thread(TokenDecoder.from_proto, decoder)
        return ModelFacts(
            name=self._served_model_name or engine_info.model,
            aliases=self._served_model_aliases,
            max_model_len=engine_info.max_model_len or tokenizer_info.max_model_len,
            eos_token_ids=frozenset(tokenizer_info.eos_token_ids),
            generate_many=engine_info.generate_many,
            default_max_tokens=engine_info.default_max_tokens if engine_info.HasField("default_max_tokens") else None,
            default_temperature=(engine_info.default_temperature if engine_info.HasField("default_temperature")
                                 else 1.0))

    @property
    def decoder(self) -> TokenDecoder:
        """The tokenizer's decoding, run here: a generation's ids become text in this process, as the
        tokenizer's Detokenize would make them, without a message there and back per token. Fetched
        with the facts; await `facts()` first."""
        assert self._decoder is not None, "await facts() before decoding"
        return self._decoder

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        request = tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._unary("tokenizer", "Encode", request)).token_ids)

    async def encode_chat(self, messages: list[tokenizer_pb2.ChatMessage], add_generation_prompt: bool,
                          chat_template: str | None, template_kwargs: dict | None,
                          continue_final_message: bool = False) -> list[int]:
        request = tokenizer_pb2.EncodeChatRequest(
            messages=messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template or "",
            template_kwargs_json=json.dumps(template_kwargs) if template_kwargs else "")
        return list((await self._unary("tokenizer", "EncodeChat", request)).token_ids)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        request = tokenizer_pb2.DecodeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._unary("tokenizer", "Decode", request)).text

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's string in the vocabulary ("Ġhello"), as /tokenize's return_token_strs gives them."""
        request = tokenizer_pb2.TokenStringsRequest(token_ids=token_ids)
        return list((await self._unary("tokenizer", "TokenStrings", request)).tokens)

    def token_texts(self, token_ids: set[int]) -> dict[int, str]:
        """The text of each single token (special tokens included), as logprobs show it."""
        return {i: self.decoder.decode([i], skip_special_tokens=False) for i in token_ids}

    async def health(self) -> dict[str, bool]:
        """Whether each upstream's gRPC health check answers SERVING."""
        async def serving(channel: grpc.aio.Channel) -> bool:
            try:
                response = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            except grpc.RpcError:
                return False
            return response.status == health_pb2.HealthCheckResponse.SERVING

        tokenizer_ok, engine_ok = await asyncio.gather(serving(self._tokenizer_channel),
                                                       serving(self._engine_channel))
        return {"tokenizer": tokenizer_ok, "engine": engine_ok}

    async def _unary(self, upstream: str, rpc: str, request, timeout_s: float | None = None):
        """``rpc`` ("Encode", ...) of the ``upstream`` ("engine" or "tokenizer") with a deadline."""
        stub, service = (self.engine, _ENGINE) if upstream == "engine" else (self.tokenizer, _TOKENIZER)
        try:
            return await client_span.call(service + rpc, self._addresses[upstream], lambda metadata: getattr(stub, rpc)(
                request, timeout=timeout_s or self.rpc_timeout_s, metadata=metadata))
        except grpc.RpcError as error:
            raise errors.from_grpc(error, upstream) from None
