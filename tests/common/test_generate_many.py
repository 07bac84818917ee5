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


async def one_message(*request_ids: str, next_token_entries: bool = False):
    yield engine_pb2.GenerateManyRequest(requests=[engine_pb2.GenerateRequest(request_id=r) for r in request_ids],
                                         next_token_entries=next_token_entries)


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


def test_a_relayed_output_of_one_token_and_usage_one_past_the_last_goes_as_next_token():
    """The router's relay to a caller that reads next_token entries: what the engine sent as next_token
    (one token, usage one completion token past the previous output's, the same replica) goes on as
    next_token; the first output, one from another replica (a migration) and the last go in full."""
    def output(token: int, completion: int, replica: str = "engine-0", finish: int = 0) -> engine_pb2.GenerateResponse:
        return engine_pb2.GenerateResponse(token_ids=[token], replica_id=replica, finish_reason=finish,
                                           usage=engine_pb2.Usage(prompt_tokens=9, completion_tokens=completion,
                                                                  cached_prompt_tokens=4))

    relayed = [output(5, 1), output(6, 2), output(7, 3), output(8, 4, "engine-1"), output(9, 5, "engine-1"),
               output(10, 7, "engine-1"), output(11, 8, "engine-1", engine_pb2.FINISH_REASON_LENGTH)]

    async def relay(request):
        for response in relayed:
            yield response

    async def run(next_token_entries: bool):
        return [o async for reply in serve_generate_many(in_tasks(relay), one_message("r", next_token_entries=
                                                                                     next_token_entries))
                for o in reply.outputs]

    entries = asyncio.run(asyncio.wait_for(run(True), timeout=5))
    assert [(e.WhichOneof("result"), e.next_token if e.HasField("next_token") else list(e.output.token_ids))
            for e in entries] == [("output", [5]), ("next_token", 6), ("next_token", 7), ("output", [8]),
                                  ("next_token", 9), ("output", [10]), ("output", [11])]
    # a caller that does not read them (no next_token_entries on its message) gets every output in full
    assert [e.output for e in asyncio.run(asyncio.wait_for(run(False), timeout=5))] == relayed
