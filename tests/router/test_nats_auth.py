"""The router trusts only authenticated NATS (issue: a forged load report once registered a rogue
"engine" that received users' prompts). NATS requires the stack's token, so a client without it is
refused by the server and its reports never reach the router; a holder of the token still cannot
grow the router's table past --max-joined-replicas, and 1,000 forged reports leave its memory flat."""

import asyncio
import time

import nats
import pytest
from nats.errors import Error as NatsError

from services.common.event_subjects import LOAD_REPORTS
from services.common.nats_auth import connect_options
from services.common.pb import engine_pb2
from tests.processes import NatsServer, RouterProcess

pytestmark = pytest.mark.slow  # starts NATS and a router


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def forged_report(i: int) -> bytes:
    return engine_pb2.LoadReport(replica_id=f"rogue-{i}", address=f"127.0.0.2:{20000 + i}",
                                 max_num_seqs=8).SerializeToString()


async def publish(url: str, count: int, **options) -> None:
    connection = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False,
                                    **options)
    for i in range(count):
        await connection.publish(LOAD_REPORTS.format(replica_id=f"rogue-{i}"), forged_report(i))
    await connection.flush()
    await connection.close()


@pytest.fixture
def router_on_nats(tmp_path, free_port_factory):
    bounds = ("--max-joined-replicas", "8", "--forget-after", "2")
    with NatsServer(free_port_factory()) as server, \
            RouterProcess(free_port_factory(), [], server.url, tmp_path / "router.log", free_port_factory(),
                          check_interval_s=0.5, extra_args=bounds) as router:
        router.wait_until(lambda: "following KV events and load reports on NATS" in router.log(),
                          what="subscribed on NATS")
        yield server, router


def test_a_report_without_credentials_never_reaches_the_router(router_on_nats):
    server, router = router_on_nats
    with pytest.raises(NatsError, match="[Aa]uthorization"):
        asyncio.run(publish(server.url, 5))  # no token: the NATS server refuses the connection
    router.wait_metrics(lambda v: "strata:router_replicas" in v)
    time.sleep(1.0)  # part of what is tested: two of its check rounds, in which a report that got through would show
    values = router.metric_values()
    assert values["strata:router_replicas"] == 0 and values.get("strata:router_refused_load_reports_total", 0) == 0


def test_a_thousand_forged_reports_leave_the_router_bounded(router_on_nats):
    server, router = router_on_nats
    router.wait_metrics(lambda v: "strata:router_replicas" in v)
    before = rss_kib(router.process.pid)
    asyncio.run(publish(server.url, 1000, **connect_options()))
    values = router.wait_metrics(lambda v: v.get("strata:router_refused_load_reports_total", 0) >= 992)
    assert values["strata:router_replicas"] <= 8
    assert "refused" in router.log()
    # The rogues never answer their health checks: they are forgotten, with their metric series (named
    # by their addresses: they never told their ids).
    values = router.wait_metrics(lambda v: v["strata:router_replicas"] == 0)
    assert not [k for k in values if "rogue" in k or "127.0.0.2:" in k]
    growth_mib = (rss_kib(router.process.pid) - before) / 1024
    assert growth_mib < 20, f"the router grew by {growth_mib:.1f} MiB"
