"""A NATS client for tests that collects every message on ``strata.>`` (KV events, load reports) in a
background thread's event loop, so that a test can wait until an event was published."""

import asyncio
import threading

from services.common.nats_auth import connect_options
from services.common.pb import engine_pb2, events_pb2
from tests.waiting import wait_until


class Subscriber:
    def __init__(self, url: str) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._subscribe(url), self._loop).result(timeout=30)

    async def _subscribe(self, url: str) -> None:
        import nats

        self._connection = await nats.connect(url, **connect_options())

        async def on_message(message) -> None:
            self.messages.append((message.subject, message.data))

        await self._connection.subscribe("strata.>", cb=on_message)
        await self._connection.flush()

    def wait_for(self, condition, timeout_s: float = 30.0) -> None:
        wait_until(condition, timeout_s, lambda: f"got {[s for s, _ in self.messages]}")

    def kv_batches(self, replica_id: str) -> list[events_pb2.KvEventBatch]:
        return [events_pb2.KvEventBatch.FromString(data) for subject, data in list(self.messages)
                if subject == f"strata.kv.{replica_id}"]

    def load_reports(self, replica_id: str) -> list[engine_pb2.LoadReport]:
        return [engine_pb2.LoadReport.FromString(data) for subject, data in list(self.messages)
                if subject == f"strata.load.{replica_id}"]

    def stored_chains(self, replica_id: str) -> list[tuple[int | None, list[int]]]:
        """(parent hash or None, block hashes) of each "stored" event the replica published, in order."""
        return [(e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None,
                 list(e.stored.block_hashes))
                for b in self.kv_batches(replica_id) for e in b.events if e.WhichOneof("event") == "stored"]

    def num_stored_blocks(self, replica_id: str) -> int:
        return sum(len(hashes) for _, hashes in self.stored_chains(replica_id))

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._connection.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
