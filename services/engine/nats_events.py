"""The engine's events on NATS: its KV-cache changes (``strata.kv.<replica_id>``, one
``KvEventBatch`` per engine step that changed the cache) and a ``LoadReport`` every
``--load-report-interval`` seconds (``strata.load.<replica_id>``), for the router's prefix index and
load view (DESIGN.md, "NATS carries events, never requests").

The engine loop fills a ``KvEventBuffer`` from the block pool (during a step, which may run on a
step thread of its own: `AsyncEngine.drive`) and, after each step, hands the step's batch to the
``NatsPublisher``; the publisher lives on the gRPC server's event loop, which owns the NATS
connection. The engine never waits for NATS: while it is away the publisher keeps at most
``max_pending`` payloads and drops the oldest, and a dropped batch shows as a gap in ``seq``, which
tells the router to stop trusting this replica's index until the next ``cleared``. A NATS that is
down at start is retried in the background.
"""

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from services.common.event_subjects import KV_EVENTS, LOAD_REPORTS
from services.common.nats_auth import connect_options
from services.common.nats_logging import connection_callbacks
from services.common.pb import events_pb2
from services.engine.protocol import load_report

log = logging.getLogger(__name__)


class KvEventBuffer:
    """A ``KvEventSink`` that keeps events as protobufs until ``take_batch``; engine thread only."""

    def __init__(self, replica_id: str, block_size: int) -> None:
        self.replica_id = replica_id
        self.block_size = block_size
        self._events: list[events_pb2.KvEvent] = []
        self._seq = 0

    def blocks_stored(self, parent_hash: int | None, block_hashes: list[int]) -> None:
        stored = events_pb2.KvBlocksStored(block_hashes=block_hashes)
        if parent_hash is not None:
            stored.parent_block_hash = parent_hash
        self._events.append(events_pb2.KvEvent(stored=stored))

    def blocks_removed(self, block_hashes: list[int]) -> None:
        self._events.append(events_pb2.KvEvent(removed=events_pb2.KvBlocksRemoved(block_hashes=block_hashes)))

    def all_cleared(self) -> None:
        self._events.append(events_pb2.KvEvent(cleared=events_pb2.KvCacheCleared()))

    def take_batch(self) -> events_pb2.KvEventBatch | None:
        """The events since the last batch as the next batch (``seq`` 1, 2, ...), or None if none came."""
        if not self._events:
            return None
        self._seq += 1
        events, self._events = self._events, []
        return events_pb2.KvEventBatch(replica_id=self.replica_id, seq=self._seq, events=events,
                                       timestamp_ns=time.time_ns(), block_size=self.block_size)


class NatsPublisher:
    """Publishes payloads on NATS from the event loop it was started on; ``publish_threadsafe`` may be
    called from any thread."""

    def __init__(self, url: str, name: str, max_pending: int = 4096) -> None:
        self.url = url
        self.name = name
        self._pending: collections.deque[tuple[str, bytes]] = collections.deque(maxlen=max_pending)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self.num_dropped = 0

    def start(self) -> None:
        """Starts connecting and sending in the background, on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="nats-publisher")

    def publish_threadsafe(self, subject: str, payload: bytes) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._enqueue, subject, payload)

    def publish(self, subject: str, payload: bytes) -> None:
        """From the publisher's own loop."""
        self._enqueue(subject, payload)

    def _enqueue(self, subject: str, payload: bytes) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.num_dropped += 1
        self._pending.append((subject, payload))
        self._wake.set()

    async def _run(self) -> None:
        import nats

        connection = None
        while connection is None:
            try:
                connection = await nats.connect(self.url, name=self.name, connect_timeout=2,
                                                max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                                allow_reconnect=True, **connection_callbacks(self.name),
                                                **connect_options())
            except Exception as error:  # down at start: keep trying, the engine serves meanwhile
                log.warning("NATS at %s unreachable (%s); retrying", self.url, error)
                await asyncio.sleep(1.0)
        log.info("publishing KV events and load reports on NATS at %s", self.url)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    subject, payload = self._pending.popleft()
                    try:
                        await connection.publish(subject, payload)
                    except Exception as error:  # lost, as a dropped batch is: the seq gap shows it
                        self.num_dropped += 1
                        log.warning("NATS publish on %s failed: %s", subject, error)
        finally:
            await connection.drain()

    async def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is pending (for up to ``timeout_s``), then closes the connection."""
        if self._task is None:
            return
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass


class EngineEvents:
    """Everything one engine publishes, in one place: the KV-event buffer its block pool fills (engine
    thread) sent as one batch after each step that changed the cache, and its load reports, every
    ``load_report_interval_s`` while it serves and a last one saying it is draining."""

    def __init__(self, replica_id: str, block_size: int, max_num_seqs: int, nats_url: str,
                 load_report_interval_s: float) -> None:
        self.replica_id = replica_id
        self.max_num_seqs = max_num_seqs
        self.buffer = KvEventBuffer(replica_id, block_size)
        self.publisher = NatsPublisher(nats_url, name=f"strata-engine-{replica_id}")
        self.load_report_interval_s = load_report_interval_s
        self._kv_subject = KV_EVENTS.format(replica_id=replica_id)
        self._load_subject = LOAD_REPORTS.format(replica_id=replica_id)
        self._reports: asyncio.Task | None = None
        self._address = ""

    def connect(self) -> None:
        """Starts the NATS connection in the background, on the running loop (the gRPC server's)."""
        self.publisher.start()

    def after_step(self, observe_step: Callable) -> Callable:
        """``observe_step``, then the step's KV events out as one batch (engine thread)."""

        def on_step(*args) -> None:
            observe_step(*args)
            batch = self.buffer.take_batch()
            if batch is not None:
                self.publisher.publish_threadsafe(self._kv_subject, batch.SerializeToString())

        return on_step

    def start_reports(self, address: str, stats: Callable) -> None:
        """Publishes a load report of ``stats()`` (a ``SchedulerStats``) every interval, as reachable at
        ``address``, from the running loop."""
        self._address = address

        async def report_forever() -> None:
            while True:
                self._publish_load(stats())
                await asyncio.sleep(self.load_report_interval_s)

        self._reports = asyncio.create_task(report_forever(), name="load-reports")

    def announce_draining(self, stats) -> None:
        """The last load report: routers stop sending here now, not at their next health check."""
        if self._reports is not None:
            self._reports.cancel()
            self._publish_load(stats, draining=True)

    async def close(self) -> None:
        await self.publisher.close()

    def _publish_load(self, stats, draining: bool = False) -> None:
        report = load_report(self.replica_id, stats, self.max_num_seqs, self._address, draining)
        self.publisher.publish(self._load_subject, report.SerializeToString())
