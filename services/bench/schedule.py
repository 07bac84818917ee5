"""A piecewise-constant arrival rate (`--request-rate-schedule 2:60,20:120,2:120`) and its arrivals.

Segments run in order; segment i sends at `rate_i` requests/s for `duration_i` seconds, and the run
lasts the sum of the durations. A rate of 0 is a pause (nothing is sent during it); `inf` is not
allowed, since a schedule describes load over time.

Arrivals are one renewal process in operational time: gaps of Gamma(shape=burstiness, scale=
1/burstiness) (mean 1; burstiness 1 is Poisson) are laid along Λ(t) = ∫ rate, and mapped back to
wall time through Λ⁻¹. Within a segment this is exactly vLLM's Gamma(burstiness,
1/(rate*burstiness)) gaps at that segment's rate; at a boundary the gap in progress stretches or
shrinks to the new rate instead of restarting, so a Poisson schedule is a Poisson process with that
rate function. Unlike a plain `--request-rate` run, no request is forced at time 0.
"""

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RateSegment:
    rate: float  # requests/s, finite, >= 0
    duration_s: float  # > 0


@dataclass(frozen=True)
class RateSchedule:
    segments: tuple[RateSegment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a request-rate schedule needs at least one RATE:SECONDS segment")
        for segment in self.segments:
            if not (math.isfinite(segment.rate) and segment.rate >= 0):
                raise ValueError(f"schedule rate {segment.rate:g} must be a finite number >= 0 "
                                 "(inf is not allowed in a schedule; use --request-rate inf)")
            if not (math.isfinite(segment.duration_s) and segment.duration_s > 0):
                raise ValueError(f"schedule duration {segment.duration_s:g} s must be > 0")
        if all(segment.rate == 0 for segment in self.segments):
            raise ValueError("every rate of the schedule is 0: it would send nothing")

    @classmethod
    def parse(cls, text: str) -> "RateSchedule":
        """"2:60,20:120" -> 2 req/s for 60 s, then 20 req/s for 120 s."""
        segments = []
        for item in text.split(","):
            rate, sep, duration = item.strip().partition(":")
            try:
                if not sep:
                    raise ValueError
                segments.append(RateSegment(float(rate), float(duration)))
            except ValueError:
                raise ValueError(f"schedule segment {item.strip()!r}: expected RATE:SECONDS, "
                                 "e.g. --request-rate-schedule 2:60,20:120,2:120") from None
        return cls(tuple(segments))

    def __str__(self) -> str:
        return ",".join(f"{s.rate:g}:{s.duration_s:g}" for s in self.segments)

    @property
    def total_duration_s(self) -> float:
        return sum(s.duration_s for s in self.segments)

    @property
    def starts_s(self) -> list[float]:
        """When each segment begins, in seconds after the run's start."""
        return [sum((s.duration_s for s in self.segments[:i]), 0.0) for i in range(len(self.segments))]

    def segment_index(self, t_s: float) -> int | None:
        """The segment running at `t_s`; None before 0 or from the schedule's end on."""
        for i, (start, segment) in enumerate(zip(self.starts_s, self.segments)):
            if start <= t_s < start + segment.duration_s:
                return i
        return None

    def rate_at(self, t_s: float) -> float:
        """The target rate at `t_s` (0 outside the schedule)."""
        index = self.segment_index(t_s)
        return 0.0 if index is None else self.segments[index].rate

    def arrival_offsets(self, burstiness: float, rng: np.random.Generator) -> np.ndarray:
        """Send times in seconds after the start, ascending, all within [0, total duration)."""
        rates = np.array([s.rate for s in self.segments])
        durations = np.array([s.duration_s for s in self.segments])
        cum_end = np.cumsum(rates * durations)  # Λ at each segment's end
        total = float(cum_end[-1])
        chunks, reached = [], 0.0
        while reached < total:  # usually one draw: the mean count plus ten standard deviations
            size = int(total - reached + 10 * math.sqrt(total - reached) / math.sqrt(burstiness)) + 16
            points = reached + np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=size))
            chunks.append(points)
            reached = float(points[-1])
        operational = np.concatenate(chunks) if chunks else np.zeros(0)
        operational = operational[operational < total]
        # Λ⁻¹: the first segment whose Λ at its end reaches u (never a rate-0 one), then linear inside
        index = np.searchsorted(cum_end, operational, side="left")
        cum_start = np.concatenate(([0.0], cum_end[:-1]))
        starts = np.concatenate(([0.0], np.cumsum(durations)[:-1]))
        return starts[index] + (operational - cum_start[index]) / rates[index]
