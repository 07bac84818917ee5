"""`services.router.migration`: what a stream cut mid-way continues as on another replica, what the
client is told of its usage, and which requests are not migrated; then a router with
`--migration-limit 1` in front of two engine processes, one killed or paused mid-stream."""

import os
import signal
import threading

import grpc
import pytest

from services.common.pb import engine_pb2
from services.router.migration import Migration
from tests.processes import RouterProcess, generate_request, start_fleet


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



@pytest.mark.slow  # starts NATS, two engines and two routers
@pytest.mark.parametrize("how, cause", [(signal.SIGKILL, ""),  # dead: gRPC words it
                                        (signal.SIGSTOP, "it stopped answering its health checks")])  # hung
def test_a_replica_failing_mid_stream_a_greedy_stream_goes_on_and_a_penalized_one_is_cut(
        default_model_dir, tmp_path, free_port_factory, how, cause):
    max_tokens = 1000
    with start_fleet(default_model_dir, tmp_path, free_port_factory, ("m0", "m1")) as fleet, \
            RouterProcess(free_port_factory(), [e.address for e in fleet.engines.values()], fleet.nats.url,
                          tmp_path / "migrating.log", free_port_factory(), check_interval_s=0.2,
                          extra_args=("--migration-limit", "1", "--policy", "round-robin")) as router:
        router.wait_serving()
        router.wait_replicas(2)
        # Sent one by one, each after the previous one's first output: round robin gives each replica
        # one greedy stream and one with a presence penalty.
        requests = [generate_request("greedy-0", [11, 12, 13], max_tokens, temperature=0.0),
                    generate_request("greedy-1", [21, 22, 23], max_tokens, temperature=0.0),
                    generate_request("penalty-0", [31, 32, 33], max_tokens, temperature=0.0, presence_penalty=0.5),
                    generate_request("penalty-1", [41, 42, 43], max_tokens, temperature=0.0, presence_penalty=0.5)]
        outputs = {r.request_id: [] for r in requests}
        errors: dict[str, grpc.RpcError] = {}

        def consume(request, started: threading.Event) -> None:
            try:
                for output in router.stub.Generate(request, timeout=120):
                    outputs[request.request_id].append(output)
                    started.set()
            except grpc.RpcError as error:
                errors[request.request_id] = error
            started.set()

        threads = []
        for request in requests:
            started = threading.Event()
            threads.append(threading.Thread(target=consume, args=(request, started)))
            threads[-1].start()
            assert started.wait(60)
        victim = outputs["greedy-0"][0].replica_id
        survivor = ({"m0", "m1"} - {victim}).pop()
        os.kill(fleet.engines[victim].process.pid, how)
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "a stream hangs"

        on_victim = {rid for rid, outs in outputs.items() if outs and outs[0].replica_id == victim}
        assert on_victim == {"greedy-0", "penalty-0"}, {rid: outs[0].replica_id for rid, outs in outputs.items()}
        greedy = outputs["greedy-0"]  # went on on the survivor: one stream, every token, the whole usage
        assert "greedy-0" not in errors, errors.get("greedy-0")
        served_by = [o.replica_id for o in greedy]
        assert 0 < served_by.count(victim) and served_by[-1] == survivor, "not cut mid-way"
        assert sum(len(o.token_ids) for o in greedy) == max_tokens
        assert greedy[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert (greedy[-1].usage.prompt_tokens, greedy[-1].usage.completion_tokens) == (3, max_tokens)
        cut = errors["penalty-0"]  # a continuation would not be the same request: the client sees the cut
        assert cut.code() == grpc.StatusCode.UNAVAILABLE
        assert f"engine replica {victim} failed mid-stream ({cause}" in cut.details()
        assert cut.details().endswith("the output is incomplete (not continued elsewhere: presence and frequency "
                                      "penalties are not migrated)"), cut.details()
        assert 0 < sum(len(o.token_ids) for o in outputs["penalty-0"]) < max_tokens
        for rid in ("greedy-1", "penalty-1"):
            assert rid not in errors and sum(len(o.token_ids) for o in outputs[rid]) == max_tokens
        assert router.metric_values()[f'strata:router_migrations_total{{replica="{victim}"}}'] == 1
