"""An engine process publishing on a real NATS server: each step's KV-cache changes as one
KvEventBatch (seq 1, 2, ... without gaps) whose stored chains are the blocks' shared hashes, so a
router can compute them from a prompt; load reports with the replica's address and pool; and an
engine that starts while NATS is down serves anyway and publishes once NATS is up."""

import pytest

from services.common.block_hash import hash_prompt_blocks
from tests.nats_subscriber import Subscriber
from tests.processes import EngineProcess, NatsServer, generate_request

BLOCK_SIZE = 16


@pytest.mark.slow  # starts NATS and an engine
def test_kv_events_and_load_reports_on_nats(default_model_dir, tmp_path, free_port_factory):
    port = free_port_factory()
    with NatsServer(free_port_factory()) as nats_server, Subscriber(nats_server.url) as subscriber, \
            EngineProcess(default_model_dir, port, tmp_path / "engine.log", ("--nats-url", nats_server.url,
                          "--replica-id", "r1", "--load-report-interval", "0.1")) as engine:
        engine.wait_serving()
        prompt = list(range(100, 140))  # two full blocks and a part
        outputs = [t for r in engine.stub.Generate(generate_request("a", prompt, 10, temperature=0.0), timeout=30)
                   for t in r.token_ids]
        expected = hash_prompt_blocks(prompt + outputs, BLOCK_SIZE)  # 50 tokens: three full blocks
        assert len(expected) == 3
        subscriber.wait_for(lambda: subscriber.num_stored_blocks("r1") >= 3)
        batches = subscriber.kv_batches("r1")
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
        assert all(b.replica_id == "r1" and b.block_size == BLOCK_SIZE for b in batches)
        chains = subscriber.stored_chains("r1")
        assert [h for _, h in chains for h in h] == expected
        # each chain continues the one before it: the first has no parent, the next one's parent is its last
        assert chains[0][0] is None
        assert all(parent == previous[-1] for (parent, _), (_, previous) in zip(chains[1:], chains))

        # the same prompt again is served from the cache: nothing new to store
        list(engine.stub.Generate(generate_request("b", prompt, 1, temperature=0.0), timeout=30))
        # a report after "b" was served shows its cache hit (reports before it may show none)
        subscriber.wait_for(lambda: subscriber.load_reports("r1")[-1:] and
                            subscriber.load_reports("r1")[-1].prefix_cache_hits > 0)
        report = subscriber.load_reports("r1")[-1]
        assert report.address == f"127.0.0.1:{port}" and report.num_kv_blocks_total == 256
        assert report.max_num_seqs == 8 and 0 < report.prefix_cache_hits <= report.prefix_cache_queries
        assert [h for _, h in subscriber.stored_chains("r1") for h in h] == expected


@pytest.mark.slow  # starts NATS and an engine
def test_an_engine_serves_while_nats_is_down_and_publishes_once_it_is_up(default_model_dir, tmp_path,
                                                                          free_port_factory):
    nats_port = free_port_factory()
    with EngineProcess(default_model_dir, free_port_factory(), tmp_path / "engine.log",
                       ("--nats-url", f"nats://127.0.0.1:{nats_port}", "--replica-id", "r2",
                        "--load-report-interval", "0.1")) as engine:
        engine.wait_serving()
        assert sum(len(r.token_ids) for r in engine.stub.Generate(generate_request("c", [7, 8, 9], 4), timeout=30)) == 4
        with NatsServer(nats_port) as nats_server, Subscriber(nats_server.url) as subscriber:
            subscriber.wait_for(lambda: subscriber.load_reports("r2"))


def test_the_reported_address_is_one_a_router_can_dial():
    from services.engine.server import _reachable_address

    assert _reachable_address("127.0.0.1", 50052) == "127.0.0.1:50052"
    assert _reachable_address("0.0.0.0", 50052, advertise="10.1.2.3") == "10.1.2.3:50052"
    assert _reachable_address("::", 50052, advertise="fd00::7") == "[fd00::7]:50052"
    assert not _reachable_address("0.0.0.0", 50052).startswith("0.0.0.0")
