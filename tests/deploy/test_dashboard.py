"""The observability files docker-compose.yml mounts: Prometheus' scrape config reaches every Strata
service where it serves /metrics (checked with promtool and against the services' own parsers), and
every metric the Grafana dashboard queries is one the service of its `job` exports (from the
services' metric registries, not from a list kept here)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from services.autoscaler.metrics import AutoscalerMetrics
from services.engine.metrics import EngineMetrics
from services.gateway.metrics import GatewayMetrics
from services.router.metrics import RouterMetrics
from services.tokenizer.metrics import TokenizerMetrics
from tests.deploy.test_compose import PARSE, SERVICES, argv_of

DEPLOY = Path(__file__).parents[2] / "deploy"
DASHBOARD = json.loads((DEPLOY / "grafana" / "dashboards" / "strata.json").read_text())
PROMETHEUS = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
REGISTRIES = {"engine": EngineMetrics("m").registry, "router": RouterMetrics().registry,
              "gateway": GatewayMetrics().registry, "autoscaler": AutoscalerMetrics().registry,
              "tokenizer": TokenizerMetrics().registry}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",),
            "summary": ("_count", "_sum"), "info": ("_info",)}


def exported(registry) -> set[str]:
    """The series names a registry exposes, labelled families included before any value is set."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES.get(family.type, ("",))}


def queries() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in DASHBOARD["panels"] for target in panel["targets"]]


def test_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: scripts/setup.sh installs Debian's prometheus package"
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_each_service_where_it_serves_metrics():
    env = {"STRATA_MODEL": ""}
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in PROMETHEUS["scrape_configs"]}
    assert set(jobs) == {"gateway", "router", "tokenizer", "engine"}
    for job, targets in jobs.items():
        (target,) = targets
        host, port = target.split(":")
        assert host in SERVICES, f"{job}: no compose service {host}"
        args = PARSE[host](argv_of(host, env))
        assert int(port) == (args.port if job == "gateway" else args.metrics_port), job


def test_every_dashboard_query_names_metrics_its_job_exports():
    everything = set().union(*(exported(r) for r in REGISTRIES.values()))
    checked = 0
    for title, expr in queries():
        job = re.search(r'job="(\w+)"', expr)
        names = set(re.findall(r"strata:[a-z0-9_:]+", expr))
        assert names, f"{title}: a query with no Strata metric"
        for name in names:
            where = exported(REGISTRIES[job.group(1)]) if job else everything
            assert name in where, f"{title}: {name} is not exported{' by the ' + job.group(1) if job else ''}"
            checked += 1
    assert checked >= 20


def labels_of(registry, name: str) -> set[str]:
    """The label names of the series ``name`` as its metric declares them (``le`` too for a histogram's
    buckets); prometheus-client keeps them on the metric object, labelled or not yet."""
    for family in registry.collect():
        suffixes = SUFFIXES.get(family.type, ("",))
        if name in {family.name + suffix for suffix in suffixes}:
            metric = registry._names_to_collectors[family.name + suffixes[0]]
            if not hasattr(metric, "_labelnames"):  # a collector of our own: the labels of its samples
                return {label for sample in family.samples if sample.name == name for label in sample.labels}
            return set(metric._labelnames) | ({"le"} if name.endswith("_bucket") else set())
    return set()


def test_every_label_a_panel_groups_or_names_by_is_on_its_metrics():
    """A per-replica panel groups by a label its metrics carry (``replica`` on an engine's own series),
    or a target label Prometheus adds (``job``, ``instance``); a legend names only such labels."""
    checked = 0
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            job = re.search(r'job="(\w+)"', expr)
            if not job:
                continue
            names = set(re.findall(r"strata:[a-z0-9_:]+", expr))
            grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
            legend = set(re.findall(r"{{(\w+)}}", target.get("legendFormat", "")))
            for name in names:
                carried = labels_of(REGISTRIES[job.group(1)], name) | {"job", "instance"}
                assert grouped | legend <= carried, f"{panel['title']}: {name} has no {(grouped | legend) - carried}"
                checked += 1
    per_replica = [p for p in DASHBOARD["panels"] if "per replica" in p["title"] and "engine" in json.dumps(p)]
    assert per_replica and all("{{replica}}" in t["legendFormat"] for p in per_replica for t in p["targets"])
    assert checked >= 20


def test_grafana_provisioning_matches_the_compose_mounts():
    mounts = {m.split(":")[1]: m.split(":")[0] for m in SERVICES["grafana"]["volumes"]}
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path] == "./deploy/grafana/dashboards"
    sources = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yml").read_text())
    uids = {source["uid"] for source in sources["datasources"]}
    assert {panel["datasource"]["uid"] for panel in DASHBOARD["panels"]} <= uids
    assert "jaeger" in uids and any("16686" in link["url"] for link in DASHBOARD["links"])
