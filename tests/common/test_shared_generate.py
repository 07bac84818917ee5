"""The shared GenerateMany stream (services/common/shared_generate.py) against a scripted call: outputs
reach the request they belong to, a request's error reads as its own Generate call's status (its
parameter in the status details), cancelling and the deadline send aborts, and a broken stream fails
its requests with UNAVAILABLE, which the gateway maps to 503 and the router retries."""

import asyncio

import grpc
import pytest

from services.common import error_details
from services.common.pb import engine_pb2
from services.common.shared_generate import SharedGenerate
from services.gateway import errors
from tests.scripted_call import ScriptedCall, Unavailable


def three_tokens_each(message: engine_pb2.GenerateManyRequest) -> engine_pb2.GenerateManyResponse | None:
    """Three outputs per request; request "bad" is refused for its top_p."""
    reply = engine_pb2.GenerateManyResponse()
    for request in message.requests:
        if request.request_id == "bad":
            reply.outputs.add(request_id="bad", error=engine_pb2.RequestError(
                code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="top_p must be in (0, 1]", param="top_p"))
        else:
            for k in range(3):
                reply.outputs.add(request_id=request.request_id, output=engine_pb2.GenerateResponse(
                    token_ids=[k], finish_reason=engine_pb2.FINISH_REASON_LENGTH if k == 2 else 0))
    return reply if reply.outputs else None


def test_outputs_reach_their_request_and_an_error_reads_as_the_requests_own_status():
    async def run():
        calls = []
        shared = SharedGenerate(lambda: calls.append(ScriptedCall(three_tokens_each)) or calls[-1])
        a, b = shared.generate(engine_pb2.GenerateRequest(request_id="a")), \
            shared.generate(engine_pb2.GenerateRequest(request_id="b"))
        bad = shared.generate(engine_pb2.GenerateRequest(request_id="bad"))
        aborted = shared.generate(engine_pb2.GenerateRequest(request_id="c"))
        running = shared.running("a")
        tokens = {"a": [t async for output in a for t in output.token_ids], "b": []}
        while (output := await b.read()) is not grpc.aio.EOF:  # read() as a Generate call's, EOF after the last
            tokens["b"].extend(output.token_ids)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await bad.read()
        aborted.cancel()
        await asyncio.sleep(0.01)
        return calls, running, tokens, info.value, shared.running("a")

    calls, running, tokens, error, still_running = asyncio.run(run())
    assert running and not still_running
    assert tokens == {"a": [0, 1, 2], "b": [0, 1, 2]}
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error_details.param_and_code(error) == ("top_p", None)
    gateway_error = errors.from_grpc(error, "engine")  # what the gateway makes of it, as of its own stream's
    assert (gateway_error.status, gateway_error.param) == (400, "top_p")
    assert [list(m.abort_request_ids) for m in calls[0].written if m.abort_request_ids] == [["c"]]
    assert all(m.next_token_entries for m in calls[0].written)  # (the call reads next_token entries)
    assert len(calls) == 1 and calls[0].half_closed


def test_a_listener_gets_each_output_as_its_reply_is_read_up_to_the_finish_or_the_error():
    async def run():
        shared = SharedGenerate(lambda: ScriptedCall(three_tokens_each))
        got = {"a": [], "bad": []}
        for request_id in got:
            shared.generate(engine_pb2.GenerateRequest(request_id=request_id)).listen(got[request_id].append)
        for _ in range(100):
            if got["a"] and got["a"][-1].finish_reason and got["bad"]:
                break
            await asyncio.sleep(0.01)
        return got, shared.running("a")

    got, still_running = asyncio.run(run())
    assert [list(output.token_ids) for output in got["a"]] == [[0], [1], [2]] and not still_running
    (error,) = got["bad"]
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT


def first_and_last_in_full(message: engine_pb2.GenerateManyRequest) -> engine_pb2.GenerateManyResponse | None:
    """Four tokens per request, as the engine sends them: the first and the last as outputs, the
    others as next_token entries."""
    reply = engine_pb2.GenerateManyResponse()
    for request in message.requests:
        add = reply.outputs.add
        add(request_id=request.request_id, output=engine_pb2.GenerateResponse(
            token_ids=[10], replica_id="engine-3",
            usage=engine_pb2.Usage(prompt_tokens=7, completion_tokens=1, cached_prompt_tokens=4)))
        add(request_id=request.request_id, next_token=11)
        add(request_id=request.request_id, next_token=12)
        add(request_id=request.request_id, output=engine_pb2.GenerateResponse(
            token_ids=[13], finish_reason=engine_pb2.FINISH_REASON_LENGTH, replica_id="engine-3",
            usage=engine_pb2.Usage(prompt_tokens=7, completion_tokens=4, cached_prompt_tokens=4)))
    return reply if reply.outputs else None


def test_a_next_token_entry_reads_as_the_output_it_stands_for_or_goes_to_a_token_listener():
    """A reader (or a listener without a token listener) gets a next_token as the output it stands for:
    the token, the previous output's usage one completion token further, its replica; a token listener
    gets the id alone, in order with the outputs around it."""
    async def run():
        shared = SharedGenerate(lambda: ScriptedCall(first_and_last_in_full))
        read = [output async for output in shared.generate(engine_pb2.GenerateRequest(request_id="read"))]
        listened, tokens = [], []
        shared.generate(engine_pb2.GenerateRequest(request_id="plain")).listen(listened.append)
        shared.generate(engine_pb2.GenerateRequest(request_id="tokens")).listen(
            tokens.append, lambda token_id: tokens.append(("token", token_id)))
        for _ in range(100):
            if len(listened) == 4 and len(tokens) == 4:
                break
            await asyncio.sleep(0.01)
        return read, listened, tokens

    read, listened, tokens = asyncio.run(run())
    for outputs in (read, listened):
        assert [(list(o.token_ids), o.usage.completion_tokens, o.usage.prompt_tokens, o.usage.cached_prompt_tokens,
                 o.replica_id, o.finish_reason) for o in outputs] == [
            ([10], 1, 7, 4, "engine-3", 0), ([11], 2, 7, 4, "engine-3", 0), ([12], 3, 7, 4, "engine-3", 0),
            ([13], 4, 7, 4, "engine-3", engine_pb2.FINISH_REASON_LENGTH)]
    assert [list(tokens[0].token_ids), tokens[1], tokens[2], list(tokens[3].token_ids)] == [
        [10], ("token", 11), ("token", 12), [13]]


def test_requests_queued_during_a_write_go_out_together_as_the_next_message():
    async def run():
        calls = []
        shared = SharedGenerate(lambda: calls.append(ScriptedCall(three_tokens_each)) or calls[-1])
        first = shared.generate(engine_pb2.GenerateRequest(request_id="r0"))
        calls[0].gate.clear()  # the first message's write waits: what the others queue meanwhile goes next
        await asyncio.sleep(0.01)
        rest = [shared.generate(engine_pb2.GenerateRequest(request_id=f"r{k}")) for k in range(1, 10)]
        calls[0].gate.set()
        tokens = [[t async for output in call for t in output.token_ids] for call in [first, *rest]]
        await asyncio.sleep(0.01)
        return calls, tokens

    calls, tokens = asyncio.run(run())
    assert len(calls) == 1 and tokens == [[0, 1, 2]] * 10
    assert [len(message.requests) for message in calls[0].written if message.requests] == [1, 9]
    assert calls[0].half_closed  # the last request left: the stream is closed


def test_a_request_past_its_deadline_gets_deadline_exceeded_and_is_aborted():
    async def run():
        calls = []
        shared = SharedGenerate(lambda: calls.append(ScriptedCall(lambda message: None)) or calls[-1], timeout_s=0.05)
        silent = shared.generate(engine_pb2.GenerateRequest(request_id="silent"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await anext(silent)
        await asyncio.sleep(0.01)
        return calls, info.value

    calls, error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert errors.from_grpc(error, "engine").status == 504
    assert [list(m.abort_request_ids) for m in calls[0].written if m.abort_request_ids] == [["silent"]]
    assert calls[0].half_closed


def test_a_broken_or_closed_stream_fails_its_requests_with_unavailable_and_the_next_request_opens_another():
    async def run():
        calls = []
        shared = SharedGenerate(lambda: calls.append(ScriptedCall(lambda message: None)) or calls[-1], "engine-1")
        waiting = [shared.generate(engine_pb2.GenerateRequest(request_id=f"r{k}")) for k in range(2)]
        await asyncio.sleep(0.01)
        calls[0].fail(Unavailable())
        broken = []
        for call in waiting:
            with pytest.raises(grpc.RpcError) as info:
                await call.read()
            broken.append(info.value.code())
        after = shared.generate(engine_pb2.GenerateRequest(request_id="later"))
        shared.close("the router is stopping")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await after.read()
        return calls, broken, info.value

    calls, broken, closed = asyncio.run(run())
    assert broken == [grpc.StatusCode.UNAVAILABLE] * 2
    assert len(calls) == 2 and calls[0].cancelled
    assert closed.code() == grpc.StatusCode.UNAVAILABLE and closed.details() == "the router is stopping"


def test_a_stream_that_grpc_reports_as_an_internal_error_from_core_fails_its_requests_with_unavailable():
    """grpc's aio client reads "Internal error from Core" (INTERNAL) instead of a status when its core fails
    an operation on the call, as when the connection breaks during a write: the server went away, which
    the router retries elsewhere (UNAVAILABLE); an INTERNAL the server sent stays as it is."""
    async def run(details):
        calls = []
        shared = SharedGenerate(lambda: calls.append(ScriptedCall(lambda message: None)) or calls[-1], "engine-1")
        waiting = shared.generate(engine_pb2.GenerateRequest(request_id="r"))
        await asyncio.sleep(0.01)
        calls[0].fail(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await waiting.read()
        return info.value

    broken = asyncio.run(run("Internal error from Core"))
    assert broken.code() == grpc.StatusCode.UNAVAILABLE
    assert broken.details() == "the shared GenerateMany stream to the engine-1 broke (Internal error from Core)"
    assert asyncio.run(run("the engine's own failure")).code() == grpc.StatusCode.INTERNAL
