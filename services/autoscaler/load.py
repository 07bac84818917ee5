"""The fleet's load as the autoscaler sees it: every engine's latest `LoadReport` from NATS
(``strata.load.*``; DESIGN.md, "NATS carries events"). A report older than ``max_age_s`` is stale
(its replica stopped reporting: dead, or draining away) and does not count; a draining replica's
report removes it at once. Only queue length and KV usage are read, never CPU."""

import logging
import time

from services.autoscaler.decision import ReplicaLoad
from services.common.event_subjects import ALL_LOAD_REPORTS
from services.common.nats_auth import connect_options
from services.common.nats_logging import connection_callbacks
from services.common.pb import engine_pb2

log = logging.getLogger(__name__)


class FleetLoad:
    def __init__(self, max_age_s: float = 5.0) -> None:
        self.max_age_s = max_age_s
        self._latest: dict[str, tuple[float, engine_pb2.LoadReport]] = {}  # replica id -> (monotonic, report)

    def apply(self, report: engine_pb2.LoadReport, now: float | None = None) -> None:
        if report.draining:
            self._latest.pop(report.replica_id, None)
            return
        self._latest[report.replica_id] = (time.monotonic() if now is None else now, report)

    def fresh(self, now: float | None = None) -> list[ReplicaLoad]:
        """The replicas that reported within ``max_age_s``; older reports are dropped."""
        now = time.monotonic() if now is None else now
        for replica_id in [r for r, (at, _) in self._latest.items() if now - at > self.max_age_s]:
            del self._latest[replica_id]
        return [ReplicaLoad(replica_id=r.replica_id, num_running=r.num_running, num_waiting=r.num_waiting,
                            kv_usage=r.num_kv_blocks_used / r.num_kv_blocks_total if r.num_kv_blocks_total else 0.0,
                            max_num_seqs=r.max_num_seqs or 1)
                for _, r in self._latest.values()]

    async def follow(self, nats_url: str):
        """Subscribes to every engine's load reports; returns the NATS connection (close it to stop)."""
        import nats

        async def on_report(message) -> None:
            self.apply(engine_pb2.LoadReport.FromString(message.data))

        connection = await nats.connect(nats_url, name="strata-autoscaler", max_reconnect_attempts=-1,
                                        reconnect_time_wait=0.5, **connection_callbacks("strata-autoscaler"),
                                        **connect_options())
        await connection.subscribe(ALL_LOAD_REPORTS, cb=on_report)
        log.info("following the engines' load reports on NATS at %s", nats_url)
        return connection
