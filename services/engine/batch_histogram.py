"""A Prometheus histogram that takes its values a batch at a time, for a series observed once per
generated token (the inter-token latency): `observe_all` counts a batch into the buckets under one
lock, where prometheus_client's `Histogram.observe` takes two locks per value (its sum's and its
bucket's) and scans the buckets one by one. Exposed as prometheus_client's own histogram is (``_bucket`` with
cumulative counts up to ``+Inf``, ``_count``, ``_sum``), without the ``_created`` sample.

Measured in one process (48 outputs a step, 400 steps): the engine's metrics took in each output in
1.14 us with every inter-token latency observed alone, 0.47 us with them counted a batch at a time;
in the stack the engine loop does this between two decode steps, on caches the step left cold.
"""

import bisect
import math
import threading
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily


class BatchHistogram:
    """One series (``labels``: its label names and values) of the histogram ``name``, registered in
    ``registry``; ``buckets``: the upper bounds, ascending (``+Inf`` is added)."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._label_names, self._label_values = list(labels), list(labels.values())
        self._upper_bounds = [float(b) for b in buckets if b != math.inf] + [math.inf]
        self._counts = [0] * len(self._upper_bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_all(self, values: Iterable[float]) -> None:
        upper_bounds, counts = self._upper_bounds, [0] * len(self._upper_bounds)
        total = 0.0
        for value in values:
            counts[bisect.bisect_left(upper_bounds, value)] += 1  # (a value equal to a bound is in its bucket)
            total += value
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts)]
            self._sum += total

    def describe(self) -> list[HistogramMetricFamily]:
        """The series' names, for the registry (which refuses a name registered twice)."""
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._label_names)]

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._label_names)
        cumulative, buckets = 0, []
        for bound, count in zip(self._upper_bounds, counts):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
        family.add_metric(self._label_values, buckets, total)
        return [family]
