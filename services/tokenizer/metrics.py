"""The tokenizer's Prometheus metrics (``strata:tokenizer_*``), served on ``--metrics-port``
(`services.common.metrics_http`): how many calls of each RPC it answered and how, how long the
one-shot ones took, the tokens it produced and turned back into text, and the open Detokenize
streams (the gateway detokenizes in-process, with the tokenizer's `Decoder`: these are other callers')."""

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 0.1 ms (a short encode) to 2.5 s (a chat template near its render deadline)
_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class TokenizerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("strata:tokenizer_requests", "RPCs answered, by method and outcome (ok, error, or "
                                "cancelled by the caller); a Detokenize stream counts once, when it ends.",
                                ["rpc", "outcome"],
                                registry=self.registry)
        self.duration = Histogram("strata:tokenizer_request_duration_seconds", "Time to answer one Encode, "
                                  "EncodeChat, Decode, TokenStrings or Decoder call.", ["rpc"], buckets=_DURATION_BUCKETS,
                                  registry=self.registry)
        self.tokens = Counter("strata:tokenizer_tokens", "Token ids produced (direction=encoded: Encode and "
                              "EncodeChat) or turned into text (direction=decoded: Decode and Detokenize).",
                              ["direction"], registry=self.registry)
        self.detokenize_streams = Gauge("strata:tokenizer_detokenize_streams", "Detokenize streams open now.",
                                        registry=self.registry)

    @contextmanager
    def answering(self, rpc: str, timed: bool = True) -> Iterator[None]:
        """Counts the call the block answers by its outcome; ``timed``: its duration too."""
        started = time.perf_counter()
        try:
            yield
        except (GeneratorExit, asyncio.CancelledError):  # the caller went away (a stop string, a disconnect)
            self.requests.labels(rpc, "cancelled").inc()
            raise
        except BaseException:
            self.requests.labels(rpc, "error").inc()
            raise
        self.requests.labels(rpc, "ok").inc()
        if timed:
            self.duration.labels(rpc).observe(time.perf_counter() - started)
