"""`services.router.migration`: what a stream cut mid-way continues as on another replica, what the
client is told of its usage, and which requests are not migrated."""

from services.common.pb import engine_pb2
from services.router.migration import Migration


def request(**sampling) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], cache_salt="tenant",
                                      sampling=engine_pb2.SamplingParams(**sampling),
                                      stop=engine_pb2.StopCriteria(max_tokens=10, min_tokens=4, stop_token_ids=[9]))


def output(ids, prompt_tokens, completion_tokens, cached=0) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(token_ids=ids, usage=engine_pb2.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_prompt_tokens=cached))


def test_the_continuation_appends_the_relayed_tokens_and_the_client_sees_the_whole_requests_usage():
    migration = Migration(request(temperature=0.0), limit=2)
    migration.relayed(output([7], 3, 1, cached=2))
    migration.relayed(output([8, 6], 3, 3, cached=2))
    assert migration.refusal() is None
    rest = migration.continuation()
    assert list(rest.prompt_token_ids) == [1, 2, 3, 7, 8, 6]
    assert (rest.stop.max_tokens, rest.stop.min_tokens, list(rest.stop.stop_token_ids)) == (7, 1, [9])
    assert (rest.request_id, rest.cache_salt, rest.sampling.temperature) == ("r", "tenant", 0.0)
    # the other replica counts the continuation's prompt and its own tokens; the client sees the request's
    relayed = migration.relayed(output([5], 6, 1, cached=6))
    assert (relayed.usage.prompt_tokens, relayed.usage.completion_tokens, relayed.usage.cached_prompt_tokens) == (3, 4, 2)
    # a second continuation carries everything relayed, and min_tokens stays at 0
    migration.relayed(output([4, 4, 4], 6, 4, cached=6))
    second = migration.continuation()
    assert list(second.prompt_token_ids) == [1, 2, 3, 7, 8, 6, 5, 4, 4, 4]
    assert (second.stop.max_tokens, second.stop.min_tokens) == (3, 0)
    assert migration.relayed(output([1], 10, 1)).usage.completion_tokens == 8
    assert migration.refusal() == "--migration-limit 2 reached"


def test_what_is_not_migrated():
    assert Migration(request(), limit=0).refusal() == "migration is off"
    assert Migration(request(presence_penalty=0.5), 1).refusal() == "presence and frequency penalties are not migrated"
    assert Migration(request(frequency_penalty=-1.0), 1).refusal() is not None
    constrained = request()
    constrained.structured_output.SetInParent()
    assert Migration(constrained, 1).refusal() == "structured output is not migrated"
    assert Migration(request(seed=7, repetition_penalty=1.2, temperature=0.8), 1).refusal() is None
