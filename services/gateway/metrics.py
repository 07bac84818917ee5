"""The gateway's Prometheus metrics, vLLM's shapes under the ``strata:`` prefix, in a registry of
its own (one per app, so tests never share state).

Only what the gateway measures itself: requests and tokens as its clients saw them, its own
requests in flight (``strata:gateway_num_requests_running``; ``strata:num_requests_running`` is an
engine's running batch) and each HTTP request's duration by route and status. The engines' queue,
KV-cache, prefix-cache and preemption figures are on each engine's own ``/metrics``, the router's
per-replica ones on the router's: Prometheus scrapes them there."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length")  # those every request may end with, counted at 0 from the start


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
            "strata:gateway_num_requests_running", "Generation requests in flight at the gateway: "
            "tokenized and sent upstream, until their response is done.", labels, registry=self.registry)
        self.http_request_duration = Histogram(
            "strata:http_request_duration_seconds", "HTTP requests, from arrival to the response's last byte "
            "(a stream's whole length), by method, route (path template; 'unmatched' for none) and status "
            "('0': the client left before a response began).", ["method", "route", "status"],
            buckets=_LATENCY_BUCKETS, registry=self.registry)
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

    def add_models(self, names) -> None:
        """Makes the series labelled with each served model name, at 0, before its first request, as
        vLLM makes its series at start: a counter that appears at its first increment hides that
        increment from Prometheus' rate() and increase(), and a query for a name or finish reason not
        seen yet answers nothing, not 0."""
        for name in names:
            for series in (self.prompt_tokens, self.generation_tokens, self.num_requests_running,
                           self.time_to_first_token, self.time_per_output_token, self.e2e_latency):
                series.labels(name)
            for reason in FINISH_REASONS:
                self.request_success.labels(name, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
