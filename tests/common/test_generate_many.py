"""The server's side of GenerateMany (services/common/generate_many.py) with a scripted ``run_one``:
the stream ends once the caller half-closed and every request ended, also when a request ends in the
same turn of the event loop as its last output (the router's relay does; the sender used to wait for
a wake-up that had already come, and the stream hung until the caller's deadline), and a failing
request gets its status as an error entry while the others go on."""

import asyncio

import grpc

from services.common.errors import InvalidRequestError
from services.common.generate_many import in_tasks, serve_generate_many
from services.common.pb import engine_pb2
from services.common.shared_generate import status_error


async def run_one(request: engine_pb2.GenerateRequest):
    if request.request_id == "refused":
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    if request.request_id == "relayed-refusal":  # a replica's status, as the router sees it
        raise status_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long", "messages", "context_length_exceeded")
    for k in range(3):
        yield engine_pb2.GenerateResponse(token_ids=[k], finish_reason=engine_pb2.FINISH_REASON_LENGTH if k == 2 else 0)


async def one_message(*request_ids: str):
    yield engine_pb2.GenerateManyRequest(requests=[engine_pb2.GenerateRequest(request_id=r) for r in request_ids])


def test_the_stream_ends_when_its_requests_end_in_the_turn_of_their_last_output():
    async def run():
        replies = []
        async for reply in serve_generate_many(in_tasks(run_one), one_message("a", "b", "refused", "relayed-refusal")):
            replies.append(reply)
        return replies

    replies = asyncio.run(asyncio.wait_for(run(), timeout=5))
    outputs = [o for reply in replies for o in reply.outputs]
    tokens = {r: [t for o in outputs if o.request_id == r for t in o.output.token_ids] for r in ("a", "b")}
    assert tokens == {"a": [0, 1, 2], "b": [0, 1, 2]}
    errors = {o.request_id: o.error for o in outputs if o.HasField("error")}
    assert (errors["refused"].code, errors["refused"].param) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "top_p")
    relayed = errors["relayed-refusal"]
    assert (relayed.message, relayed.param, relayed.error_code) == ("prompt too long", "messages",
                                                                    "context_length_exceeded")
