"""The router as a real process in front of two engine processes, following their KV events on a
real NATS server: a prompt's prefix pulls its requests to the replica that cached it, distinct
requests spread over both, an engine's refusal passes through as it is, and when a replica dies
its requests go to the other one without the client seeing an error, also when it hangs (paused)
rather than dies."""

import os
import signal

import grpc
import pytest

from services.common.pb import engine_pb2
from tests.many_entries import as_outputs
from tests.nats_subscriber import Subscriber
from tests.processes import RouterProcess, generate_request, start_fleet

pytestmark = pytest.mark.slow  # starts NATS, engines and routers


@pytest.fixture(scope="module")
def fleet(default_model_dir, tmp_path_factory, free_port_factory):
    """The router in front of two engines (e0, e1; its health checks a minute apart), the engines, and a
    subscriber to their KV events: a test waits until a request's blocks are published to the router."""
    with start_fleet(default_model_dir, tmp_path_factory.mktemp("fleet"), free_port_factory, ("e0", "e1"),
                     ("--load-report-interval", "0.2")) as running, Subscriber(running.nats.url) as events:
        running.router.nats_url = running.nats.url
        yield running.router, running.engines, events


def wait_for_stored_blocks(events: Subscriber, replica_id: str, before: dict[str, int], num_blocks: int) -> None:
    """Until ``replica_id`` has published ``num_blocks`` more stored blocks than ``before`` counted; the
    router is subscribed to the same subjects on the same server."""
    events.wait_for(lambda: events.num_stored_blocks(replica_id) >= before[replica_id] + num_blocks)


def served_by(router, request_id, prompt, max_tokens=2) -> str:
    outputs = list(router.stub.Generate(generate_request(request_id, prompt, max_tokens, temperature=0.0), timeout=60))
    assert sum(len(o.token_ids) for o in outputs) == max_tokens
    return outputs[-1].replica_id


def test_info_and_load_speak_for_the_fleet(fleet):
    router, _, _ = fleet
    info = router.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)
    assert info.replica_id == "router-0" and info.num_kv_blocks == 2 * 256 and info.vocab_size == 4096
    assert info.generate_many  # each request on the stream is placed and relayed on its own
    load = router.stub.Load(engine_pb2.LoadRequest(), timeout=5)
    assert load.num_kv_blocks_total == 2 * 256


def test_a_cached_prefix_pulls_its_requests_to_its_replica(fleet):
    router, engines, events = fleet
    shared = list(range(200, 264))  # four full blocks
    before = {name: events.num_stored_blocks(name) for name in engines}
    first = served_by(router, "p0", shared + [1])
    wait_for_stored_blocks(events, first, before, 4)
    for i in range(1, 6):
        assert served_by(router, f"p{i}", shared + [i + 1, i + 2]) == first
    # Distinct prompts have no cache anywhere: equal cost, so they alternate.
    replicas = {served_by(router, f"d{i}", [300 + 17 * i + j for j in range(40)]) for i in range(6)}
    assert replicas == {"e0", "e1"}


def test_generate_many_through_the_router_places_each_request_and_answers_as_generate_does(fleet):
    """One GenerateMany stream to the router: each request gets Generate's outputs (greedy), placed on
    its own (two distinct prompts spread over both replicas, alternating at equal cost); a refused
    request gets its error entry with its parameter, and the others go on."""
    router, _, _ = fleet
    prompts = {f"m{i}": [800 + 13 * i + j for j in range(30)] for i in range(4)}
    requests = [generate_request(rid, prompt, 6, temperature=0.0) for rid, prompt in prompts.items()]
    requests.append(generate_request("m-bad", [1, 2], 2, top_p=1.5))
    outputs: dict[str, list] = {}
    message = engine_pb2.GenerateManyRequest(requests=requests, next_token_entries=True)
    for reply in router.stub.GenerateMany(iter([message]), timeout=60):
        for output in reply.outputs:
            outputs.setdefault(output.request_id, []).append(output)
    bad = outputs.pop("m-bad")
    assert len(bad) == 1 and bad[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad[0].error.param == "top_p"
    replicas = set()
    for rid, prompt in prompts.items():
        relayed = as_outputs(outputs[rid])
        alone = list(router.stub.Generate(generate_request(f"{rid}-alone", prompt, 6, temperature=0.0), timeout=60))
        assert [t for o in relayed for t in o.token_ids] == [t for o in alone for t in o.token_ids]
        assert [(o.usage.prompt_tokens, o.usage.completion_tokens) for o in relayed] == [(30, k + 1) for k in range(6)]
        # (the engine's next_token entries go on as such: all but the first and the last)
        assert [o.WhichOneof("result") for o in outputs[rid]] == ["output"] + ["next_token"] * 4 + ["output"]
        replicas.add(relayed[-1].replica_id)
        assert relayed[-1].finish_reason
    assert replicas == {"e0", "e1"}


def test_a_router_without_addresses_finds_the_engines_by_their_load_reports(fleet, tmp_path, free_port_factory):
    router, _, _ = fleet
    with RouterProcess(free_port_factory(), [], router.nats_url, tmp_path / "finder.log", free_port_factory(),
                       check_interval_s=0.2) as finder:
        finder.wait_serving()
        finder.wait_replicas(2)
        assert served_by(finder, "found", [11, 12, 13]) in {"e0", "e1"}


def test_an_engines_refusal_passes_through(fleet):
    router, _, _ = fleet
    with pytest.raises(grpc.RpcError) as error:
        list(router.stub.Generate(generate_request("bad", [999_999], 2), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in error.value.details()


def test_a_request_waiting_on_a_hung_replica_moves_when_its_health_checks_fail(fleet, tmp_path, free_port_factory):
    router, engines, _ = fleet
    with RouterProcess(free_port_factory(), [e.address for e in engines.values()], router.nats_url,
                       tmp_path / "watcher.log", free_port_factory(), check_interval_s=0.2,
                       extra_args=("--policy", "round-robin")) as watcher:
        watcher.wait_serving()
        watcher.wait_replicas(2)
        hung = engines["e1"].process
        os.kill(hung.pid, signal.SIGSTOP)  # it holds its connections but answers nothing
        try:
            # Round robin sends one of the first two there before a health check (1 s timeout) fails;
            # that request must move to e0 then, not wait on the paused process.
            served = [served_by(watcher, f"h{i}", [700 + i] * 20) for i in range(4)]
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        assert served == ["e0"] * 4
        assert watcher.metric_values()['strata:router_failovers_total{replica="e1"}'] == 1


def test_requests_go_on_when_a_replica_dies(fleet):
    router, engines, events = fleet
    shared = list(range(500, 548))  # three full blocks
    before = {name: events.num_stored_blocks(name) for name in engines}
    victim = served_by(router, "v0", shared)
    wait_for_stored_blocks(events, victim, before, 3)
    engines[victim].process.kill()
    engines[victim].process.wait(timeout=10)
    survivor = ({"e0", "e1"} - {victim}).pop()
    # The next request prefers the dead replica (its cache); the router has not checked it since (the
    # checks are a minute apart here), so the call fails before any token and the request moves over.
    assert served_by(router, "v1", shared + [7]) == survivor
    assert all(served_by(router, f"v{i}", [600 + i] * 20) == survivor for i in range(2, 6))
    metrics = router.metric_values()
    assert metrics[f'strata:router_failovers_total{{replica="{victim}"}}'] == 1
    assert metrics[f'strata:router_requests_total{{replica="{survivor}"}}'] >= 5
    assert metrics[f'strata:router_replica_healthy{{replica="{survivor}"}}'] == 1

