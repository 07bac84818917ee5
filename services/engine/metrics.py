"""The engine's Prometheus metrics, named as vLLM's with the `strata:` prefix (label `model_name`)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics_http import start_metrics_server
from services.engine.scheduler import SchedulerStats
from services.engine.scheduler_output import RequestOutput

_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class EngineMetrics:
    """Updated from the engine thread after each step; served by `services.common.metrics_http`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"strata:{name}", doc, labels + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"strata:{name}", doc, labels, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self.request_success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).").labels(model_name)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.").labels(model_name)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(model_name)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use, in [0, 1].")
        self.iteration_tokens = Histogram("strata:iteration_tokens_total", "Tokens computed per engine step.",
                                          labels, buckets=_TOKEN_BUCKETS, registry=self.registry).labels(model_name)
        self.step_seconds = Histogram("strata:engine_step_seconds", "Wall time of one engine step.", labels,
                                      registry=self.registry).labels(model_name)
        self.model_name = model_name
        self._last: SchedulerStats | None = None

    def start_http_server(self, host: str, port: int) -> None:
        start_metrics_server(host, port, self.registry)

    def observe_step(self, outputs: list[RequestOutput], stats: SchedulerStats, step_seconds: float,
                     num_batched_tokens: int = 0) -> None:
        for output in outputs:
            num_new = len(output.new_token_ids)
            self.generation_tokens.inc(num_new)
            if num_new and output.num_output_tokens == num_new:
                self.prompt_tokens.inc(output.num_prompt_tokens)
            if output.finished:
                self.request_success.labels(self.model_name, output.finish_reason).inc()
        last = self._last
        self.preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        self.prefix_queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        self.prefix_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        self._last = stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1))
        if num_batched_tokens:
            self.iteration_tokens.observe(num_batched_tokens)
        self.step_seconds.observe(step_seconds)
