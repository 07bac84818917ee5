"""The engine's Prometheus metrics, named as vLLM's with the `strata:` prefix, each series labelled
with the served ``model_name`` and the ``replica`` id (as the router labels its per-replica series),
so that replicas scraped under one job (a Kubernetes Deployment's pods) stay apart."""

import threading
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics_http import start_metrics_server
from services.engine.batch_histogram import BatchHistogram
from services.engine.scheduler import SchedulerStats
from services.engine.scheduler_output import RequestOutput
from services.engine.structured_output.grammars import GrammarStats
from services.engine.structured_output.masks import MaskStats

_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# vLLM's: its request latency buckets for the decode and inference times; its time-to-first-token
# buckets for the queue and prefill times, the parts of TTFT, which are often under vLLM's first
# latency bucket (0.3 s); its inter-token latency buckets; 1-2-5 steps for request lengths.
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                        20.0, 40.0, 80.0)
_LENGTH_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # 1 .. 5,000,000 tokens
_GRAMMAR_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# The engine loop queues each step's outputs and stats; the series take them in when they are
# collected (a scrape of /metrics) or once this many outputs wait, whichever comes first. Recording a
# step as it ended cost the loop ~40 us per step at one stream (30 for these series, 9 for the
# structured-output ones; their code and data are cold after the weights went through the caches),
# in series with the next step; taken in together they stay warm, and a catch-up holds the loop (or,
# from a scrape, the GIL) for about a millisecond at most.
MAX_QUEUED_OUTPUTS = 256
# The finish reasons request_success counts, whose series exist at 0 from the start, as vLLM makes
# one per reason: a series that appears at its first increment hides that increment from
# Prometheus' rate() and increase(), and a query for a reason not seen yet answers nothing, not 0.
FINISH_REASONS = ("stop", "length")


class EngineMetrics:
    """Fed from the engine loop after each step (`observe_step`, queued; see ``MAX_QUEUED_OUTPUTS``);
    served by `services.common.metrics_http`, whose scrape takes in what is queued first."""

    def __init__(self, model_name: str, replica_id: str = "") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_CatchUpFirst(self.catch_up))  # first: collected before every series
        self._queued: deque = deque()  # (outputs, stats, step_seconds, num_batched_tokens) per step
        self._outputs_since_catch_up = 0  # the engine loop's own count
        self._catch_up_lock = threading.Lock()
        self._also_on_catch_up: list[Callable[[], None]] = []
        labels = ["model_name", "replica"]
        values = (model_name, replica_id)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"strata:{name}", doc, labels + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"strata:{name}", doc, labels, registry=self.registry).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"strata:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(*values)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.").labels(*values)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(*values)
        self.request_success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        for reason in FINISH_REASONS:  # at 0 from the start, as vLLM makes them (see FINISH_REASONS)
            self.request_success.labels(*values, reason)
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).").labels(*values)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.").labels(*values)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(*values)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use, in [0, 1].")
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.", _TOKEN_BUCKETS)
        self.step_seconds = Histogram("strata:engine_step_seconds", "Wall time of one engine step.", labels,
                                      registry=self.registry).labels(*values)
        # Per finished request (stop or length), from the engine's own clock; see RequestTimes.
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival in the engine to first "
                                    "scheduled (a preempted request's later waits excluded).", _FIRST_TOKEN_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduled to the first "
                                      "token.", _FIRST_TOKEN_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from the first token to the last.",
                                     _REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Time from first scheduled to the last "
                                        "token.", _REQUEST_LATENCY_BUCKETS)
        # one value per generated token: taken in a catch-up's worth at a time (see BatchHistogram)
        self.inter_token_latency = BatchHistogram("strata:inter_token_latency_seconds", "Time between two "
                                                  "consecutive tokens of a request.", dict(zip(labels, values)),
                                                  _INTER_TOKEN_BUCKETS, self.registry)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                               _LENGTH_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per finished "
                                                   "request.", _LENGTH_BUCKETS)
        # Structured output: compilations (a cache hit compiles nothing), and per step with constrained
        # requests the time filling their masks and the part of it the step waited for after the forward.
        self.grammar_compile_time = histogram("structured_output_compile_seconds", "Time to compile a "
                                              "structured-output constraint (cache misses).", _GRAMMAR_BUCKETS)
        self.grammar_cache_queries = counter("structured_output_cache_queries", "Structured-output constraints "
                                             "looked up in the compiled-grammar cache.").labels(*values)
        self.grammar_cache_hits = counter("structured_output_cache_hits", "Structured-output constraints found "
                                          "compiled in the cache.").labels(*values)
        self.mask_fill_time = histogram("structured_output_mask_seconds", "Time filling the token masks of one "
                                        "step's constrained requests (while the model runs).", _GRAMMAR_BUCKETS)
        self.mask_wait_time = histogram("structured_output_mask_wait_seconds", "Time a step waited for its "
                                        "token masks after the model ran.", _GRAMMAR_BUCKETS)
        self._values = values
        self._last: SchedulerStats | None = None

    def start_http_server(self, host: str, port: int) -> None:
        start_metrics_server(host, port, self.registry)

    def observe_structured_output(self, grammars: GrammarStats, masks: MaskStats) -> None:
        for seconds in grammars.compile_seconds:
            self.grammar_compile_time.observe(seconds)
        self.grammar_cache_queries.inc(grammars.cache_queries)
        self.grammar_cache_hits.inc(grammars.cache_hits)
        for seconds in masks.fill_seconds:
            self.mask_fill_time.observe(seconds)
        for seconds in masks.wait_seconds:
            self.mask_wait_time.observe(seconds)

    def on_catch_up(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` (from the scraping thread or the engine loop) whenever the queued steps
        are taken in: for stats kept elsewhere that it passes to the series (structured output)."""
        self._also_on_catch_up.append(callback)

    def observe_load(self, stats: SchedulerStats) -> None:
        """Sets the gauges of the engine's load (running, waiting, KV usage) from ``stats``. A step sets
        them as of its end; the server also passes the engine's current stats at every scrape
        (`on_catch_up`): requests aborted while no step runs (every client gone) change the load
        with no step after them, and the gauges KEDA scales on must not stay at the last step's."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1))

    def observe_step(self, outputs: list[RequestOutput], stats: SchedulerStats, step_seconds: float,
                     num_batched_tokens: int = 0) -> None:
        """Queues a step for the series: ``outputs`` are the step's, ``stats`` the scheduler's after it."""
        self._queued.append((outputs, stats, step_seconds, num_batched_tokens))
        self._outputs_since_catch_up += len(outputs)
        if self._outputs_since_catch_up >= MAX_QUEUED_OUTPUTS:
            self._outputs_since_catch_up = 0
            self.catch_up()

    def catch_up(self) -> None:
        """Takes the queued steps into the series, in order; safe from any thread."""
        with self._catch_up_lock:
            inter_token_s: list[float] = []
            while self._queued:
                self._record_step(*self._queued.popleft(), inter_token_s)
            self.inter_token_latency.observe_all(inter_token_s)
            for callback in self._also_on_catch_up:
                callback()

    def _record_step(self, outputs: list[RequestOutput], stats: SchedulerStats, step_seconds: float,
                     num_batched_tokens: int, inter_token_s: list[float]) -> None:
        """Takes a step into the series; its outputs' inter-token latencies into ``inter_token_s``."""
        generated = prompts = 0  # counted over the step, each counter's lock taken once
        for output in outputs:
            generated += len(output.new_token_ids)
            if output.is_first:
                prompts += output.num_prompt_tokens
            times = output.times
            if (since_previous := times.inter_token_s) is not None:
                inter_token_s.append(since_previous)
            if output.finished:
                self.request_success.labels(*self._values, output.finish_reason).inc()
                self.queue_time.observe(times.queue_s)
                self.prefill_time.observe(times.prefill_s)
                self.decode_time.observe(times.decode_s)
                self.inference_time.observe(times.inference_s)
                self.request_prompt_tokens.observe(output.num_prompt_tokens)
                self.request_generation_tokens.observe(output.num_output_tokens)
        self.generation_tokens.inc(generated)
        if prompts:
            self.prompt_tokens.inc(prompts)
        last = self._last
        self.preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        self.prefix_queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        self.prefix_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        self._last = stats
        self.observe_load(stats)
        if num_batched_tokens:
            self.iteration_tokens.observe(num_batched_tokens)
        self.step_seconds.observe(step_seconds)


class _CatchUpFirst:
    """A collector of no series of its own: collecting it takes the queued steps in."""

    def __init__(self, catch_up: Callable[[], None]) -> None:
        self._catch_up = catch_up

    def collect(self) -> list:
        self._catch_up()
        return []
