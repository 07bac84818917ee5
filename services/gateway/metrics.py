"""The gateway's Prometheus metrics, vLLM's shapes under the ``strata:`` prefix, in a registry of
its own (one per app, so tests never share state)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.common.pb import engine_pb2

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.request_success = Counter(
            "strata:request_success", "Finished choices, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self.request_errors = Counter(
            "strata:request_errors", "Errors answered, by HTTP status and OpenAI error type; an error "
            "after a stream began counts with the status it would have had.",
            ["status_code", "error_type"], registry=self.registry)
        self.num_requests_admitted = Gauge(
            "strata:num_requests_admitted", "Generation requests in progress at the gateway, streams "
            "until their last byte (bounded by --max-concurrent-requests).", registry=self.registry)
        self.prompt_tokens = Counter(
            "strata:prompt_tokens", "Prompt tokens of served requests.", labels, registry=self.registry)
        self.generation_tokens = Counter(
            "strata:generation_tokens", "Generated tokens.", labels, registry=self.registry)
        self.num_requests_running = Gauge(
            "strata:num_requests_running", "Requests in flight at the gateway.", labels,
            registry=self.registry)
        self.time_to_first_token = Histogram(
            "strata:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            "strata:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.", labels,
            buckets=_TOKEN_LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram(
            "strata:e2e_request_latency_seconds", "Time from arrival to the last token.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self, engine_load: engine_pb2.LoadResponse | None = None, model_name: str = "") -> bytes:
        """The gateway's own metrics, then the engine's (from its Load RPC) when given."""
        text = generate_latest(self.registry)
        if engine_load is not None:
            registry = CollectorRegistry()
            registry.register(_EngineLoadCollector(engine_load, model_name))
            text += generate_latest(registry)
        return text


class _EngineLoadCollector:
    """The engine's scheduler and prefix-cache figures as Prometheus metrics (vLLM's names), so one
    scrape of the gateway shows server-side cache hits and preemptions beside the request metrics."""

    def __init__(self, load: engine_pb2.LoadResponse, model_name: str) -> None:
        self.load = load
        self.labels = ["model_name", "replica"]
        self.values = [model_name, load.replica_id]

    def collect(self):
        load = self.load
        gauges = [
            ("strata:num_requests_waiting", "Requests waiting in the engine's queue.", load.num_waiting),
            ("strata:engine_num_requests_running", "Requests in the engine's running batch.", load.num_running),
            ("strata:kv_cache_usage_perc", "Fraction of KV blocks in use, in [0, 1].",
             load.num_kv_blocks_used / max(load.num_kv_blocks_total, 1)),
        ]
        counters = [
            ("strata:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", load.prefix_cache_queries),
            ("strata:prefix_cache_hits", "Prompt tokens found in the prefix cache.", load.prefix_cache_hits),
            ("strata:num_preemptions", "Requests preempted (recomputed later).", load.num_preemptions),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=self.labels)
            family.add_metric(self.values, value)
            yield family
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=self.labels)
            family.add_metric(self.values, value)
            yield family
