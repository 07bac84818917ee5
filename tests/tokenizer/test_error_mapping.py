"""services.common.grpc_server maps domain errors to status codes for unary and streaming RPCs alike."""

import asyncio

import grpc
import pytest

from services.common.errors import InvalidRequestError, ResourceExhaustedError, ServiceUnavailableError
from services.common.grpc_server import GrpcServer
from services.common.pb import tokenizer_pb2 as pb
from services.common.pb import tokenizer_pb2_grpc


class FailingServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Raises the error named by the request text (Encode) or after one response (Detokenize)."""

    ERRORS = {
        "invalid": InvalidRequestError("bad input"),
        "exhausted": ResourceExhaustedError("too busy"),
        "unavailable": ServiceUnavailableError("still loading"),
        "bug": KeyError("oops"),
    }

    async def Encode(self, request, context):
        raise self.ERRORS[request.text]

    async def Detokenize(self, request_iterator, context):
        async for request in request_iterator:
            yield pb.DetokenizeResponse(text_delta="first")
            raise self.ERRORS["invalid"]


EXPECTED = {
    "invalid": (grpc.StatusCode.INVALID_ARGUMENT, "bad input"),
    "exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, "too busy"),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, "still loading"),
    "bug": (grpc.StatusCode.INTERNAL, "internal error: KeyError: 'oops'"),
}


def test_errors_become_status_codes(caplog):
    async def scenario():
        server = GrpcServer(["strata.v1.Tokenizer"])
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(FailingServicer(), server.server)
        port = server.add_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                unary = {}
                for name in EXPECTED:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.Encode(pb.EncodeRequest(text=name))
                    unary[name] = (caught.value.code(), caught.value.details())
                call = stub.Detokenize(iter([pb.DetokenizeRequest(token_ids=[1])]))
                first = await call.read()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call.read()
                return unary, first.text_delta, caught.value.code()
        finally:
            await server.stop()

    unary, first_delta, stream_code = asyncio.run(scenario())
    assert unary == EXPECTED
    assert (first_delta, stream_code) == ("first", grpc.StatusCode.INVALID_ARGUMENT)
    assert "KeyError: 'oops'" in caplog.text  # only the unexpected error is logged, with its traceback
