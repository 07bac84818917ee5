"""The engine's periodic stats line, as vLLM prints it: every ``interval_s`` (10 s) while there is
traffic, and once more after it stops (its throughput then reads 0), silent while idle:

    Engine engine-0: Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.4 tokens/s,
    Running: 4 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 48.0%

(one line). Prompt tokens count when a request's first token comes out, as vLLM counts them. The hit
rate is over the prompt tokens looked up in the interval (over all so far when none were).
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from services.engine.scheduler import SchedulerStats
from services.engine.scheduler_output import RequestOutput

log = logging.getLogger(__name__)


class StatsLogger:
    """``observe_step`` from the engine thread after each step; ``log_stats`` (or ``run``) from the
    event loop, with the engine's current stats."""

    def __init__(self, replica_id: str, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id = replica_id
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_at = clock()
        self._last_prefix = (0, 0)  # queries, hits at the last line
        self._was_busy = False

    def observe_step(self, outputs: list[RequestOutput], *_) -> None:
        prompt = generation = 0
        for output in outputs:
            generation += len(output.new_token_ids)
            if output.is_first:
                prompt += output.num_prompt_tokens
        with self._lock:
            self._num_prompt_tokens += prompt
            self._num_generation_tokens += generation

    def log_stats(self, stats: SchedulerStats) -> str | None:
        """Logs the line for the time since the last call and returns it; None (and nothing logged)
        when the engine was idle then and the time before."""
        now = self._clock()
        with self._lock:
            prompt, generation = self._num_prompt_tokens, self._num_generation_tokens
            self._num_prompt_tokens = self._num_generation_tokens = 0
        elapsed, self._last_at = max(now - self._last_at, 1e-9), now
        busy = bool(prompt or generation or stats.num_running or stats.num_waiting)
        was_busy, self._was_busy = self._was_busy, busy
        if not (busy or was_busy):
            return None
        queries = stats.prefix_cache_queries - self._last_prefix[0]
        hits = stats.prefix_cache_hits - self._last_prefix[1]
        if queries <= 0:
            queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self._last_prefix = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        line = (f"Engine {self.replica_id}: Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1):.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        log.info("%s", line)
        return line

    async def run(self, stats: Callable[[], SchedulerStats]) -> None:
        """Logs every ``interval_s`` with ``stats()``, until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_stats(stats())
