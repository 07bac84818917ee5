"""An engine process publishing on a real NATS server: each step's KV-cache changes as one
KvEventBatch (seq 1, 2, ... without gaps) whose stored chains are the blocks' shared hashes, so a
router can compute them from a prompt; load reports with the replica's address and pool; and an
engine that starts while NATS is down serves anyway and publishes once NATS is up."""

import asyncio
import time

import pytest

from services.common.block_hash import hash_prompt_blocks
from services.common.nats_auth import connect_options
from services.common.pb import events_pb2
from tests.engine.test_engine_server import EngineProcess, generate_request
from tests.nats_server import NatsServer

BLOCK_SIZE = 16


class Subscriber:
    """Collects every message on ``strata.>`` in a background thread's event loop."""

    def __init__(self, url: str) -> None:
        import threading

        self.messages: list[tuple[str, bytes]] = []
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._subscribe(url), self._loop).result(timeout=10)

    async def _subscribe(self, url: str) -> None:
        import nats

        self._connection = await nats.connect(url, **connect_options())

        async def on_message(message) -> None:
            self.messages.append((message.subject, message.data))

        await self._connection.subscribe("strata.>", cb=on_message)
        await self._connection.flush()

    def wait_for(self, condition, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out; got {[s for s, _ in self.messages]}"
            time.sleep(0.05)

    def kv_batches(self, replica_id: str) -> list[events_pb2.KvEventBatch]:
        return [events_pb2.KvEventBatch.FromString(data) for subject, data in list(self.messages)
                if subject == f"strata.kv.{replica_id}"]

    def load_reports(self, replica_id: str) -> list[events_pb2.LoadReport]:
        return [events_pb2.LoadReport.FromString(data) for subject, data in list(self.messages)
                if subject == f"strata.load.{replica_id}"]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._connection.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def stored_chains(batches) -> list[tuple[int | None, list[int]]]:
    return [(e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None, list(e.stored.block_hashes))
            for b in batches for e in b.events if e.WhichOneof("event") == "stored"]


def test_kv_events_and_load_reports_on_nats(default_model_dir, tmp_path, free_port_factory):
    nats_server = NatsServer(free_port_factory())
    subscriber = Subscriber(nats_server.url)
    port = free_port_factory()
    engine = EngineProcess(default_model_dir, port, tmp_path / "engine.log",
                           ("--nats-url", nats_server.url, "--replica-id", "r1", "--load-report-interval", "0.1"))
    try:
        engine.wait_serving()
        prompt = list(range(100, 140))  # two full blocks and a part
        outputs = [t for r in engine.stub.Generate(generate_request("a", prompt, 10, temperature=0.0), timeout=30)
                   for t in r.token_ids]
        expected = hash_prompt_blocks(prompt + outputs, BLOCK_SIZE)  # 50 tokens: three full blocks
        assert len(expected) == 3
        subscriber.wait_for(lambda: sum(len(h) for _, h in stored_chains(subscriber.kv_batches("r1"))) >= 3)
        batches = subscriber.kv_batches("r1")
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
        assert all(b.replica_id == "r1" and b.block_size == BLOCK_SIZE for b in batches)
        chains = stored_chains(batches)
        assert [h for _, h in chains for h in h] == expected
        # each chain continues the one before it: the first has no parent, the next one's parent is its last
        assert chains[0][0] is None
        assert all(parent == previous[-1] for (parent, _), (_, previous) in zip(chains[1:], chains))

        # the same prompt again is served from the cache: nothing new to store
        list(engine.stub.Generate(generate_request("b", prompt, 1, temperature=0.0), timeout=30))
        subscriber.wait_for(lambda: len(subscriber.load_reports("r1")) >= 2)
        report = subscriber.load_reports("r1")[-1]
        assert report.address == f"127.0.0.1:{port}" and report.num_kv_blocks_total == 256
        assert report.max_num_seqs == 8 and 0 < report.prefix_cache_hit_rate <= 1
        assert [h for _, h in stored_chains(subscriber.kv_batches("r1")) for h in h] == expected
    finally:
        engine.close()
        subscriber.close()
        nats_server.stop()


def test_an_engine_serves_while_nats_is_down_and_publishes_once_it_is_up(default_model_dir, tmp_path,
                                                                          free_port_factory):
    nats_port = free_port_factory()
    engine = EngineProcess(default_model_dir, free_port_factory(), tmp_path / "engine.log",
                           ("--nats-url", f"nats://127.0.0.1:{nats_port}", "--replica-id", "r2",
                            "--load-report-interval", "0.1"))
    nats_server = subscriber = None
    try:
        engine.wait_serving()
        assert sum(len(r.token_ids) for r in engine.stub.Generate(generate_request("c", [7, 8, 9], 4), timeout=30)) == 4
        nats_server = NatsServer(nats_port)
        subscriber = Subscriber(nats_server.url)
        subscriber.wait_for(lambda: subscriber.load_reports("r2"))
    finally:
        engine.close()
        if subscriber:
            subscriber.close()
        if nats_server:
            nats_server.stop()


def test_the_reported_address_is_one_a_router_can_dial():
    from services.engine.server import _reachable_address

    assert _reachable_address("127.0.0.1", 50052) == "127.0.0.1:50052"
    assert _reachable_address("0.0.0.0", 50052, advertise="10.1.2.3") == "10.1.2.3:50052"
    assert _reachable_address("::", 50052, advertise="fd00::7") == "[fd00::7]:50052"
    assert not _reachable_address("0.0.0.0", 50052).startswith("0.0.0.0")
