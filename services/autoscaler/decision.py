"""How many engine replicas the fleet should have: pure code, no I/O, time passed in by the caller.

``recommend`` reads the ready replicas' load (queue length and KV-cache usage, never CPU) and says
what count it asks for right now. ``Autoscaler.decide`` turns that into an action with the
HorizontalPodAutoscaler's semantics (a tolerance around the targets, a stabilization window per
direction) plus a cooldown between actions, and never acts while a scale-up is still warming: a
new replica serves nobody until its model is loaded, so the load it will take is not yet visible.
"""

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.autoscaler.provider import FleetState


@dataclass(frozen=True)
class ReplicaLoad:
    """One ready replica's latest load report."""

    replica_id: str
    num_running: int
    num_waiting: int
    kv_usage: float  # used / total KV blocks, in [0, 1]
    max_num_seqs: int  # its batch slots


@dataclass(frozen=True)
class ScalingPolicy:
    """When the fleet grows and shrinks; validated at construction (messages name the CLI flags,
    ``--`` + the field name with dashes)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_waiting: float = 2.0  # waiting requests per ready replica before the fleet grows
    target_kv_usage: float = 0.8  # mean KV usage before the fleet grows
    scale_down_utilization: float = 0.5  # shrink to m replicas only if the load fits on m at this fraction
    tolerance: float = 0.1  # no scale-up while metric / target <= 1 + tolerance
    scale_up_stabilization_s: float = 0.0  # act on the lowest recommendation within this window
    scale_down_stabilization_s: float = 60.0  # act on the highest recommendation within this window
    cooldown_s: float = 30.0  # after a scale action, no other for this long
    warmup_timeout_s: float = 600.0  # a replica starting longer than this no longer blocks decisions

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"--min-replicas {self.min_replicas} must be at least 1: with no replica "
                             "nothing reports load to scale up from")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"--max-replicas {self.max_replicas} is below --min-replicas {self.min_replicas}; "
                             "raise --max-replicas or lower --min-replicas")
        if self.target_waiting <= 0:
            raise ValueError(f"--target-waiting {self.target_waiting} must be > 0 (waiting requests per replica)")
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError(f"--target-kv-usage {self.target_kv_usage} must be in (0, 1], a fraction of the "
                             "KV blocks")
        if not 0 < self.scale_down_utilization <= 1:
            raise ValueError(f"--scale-down-utilization {self.scale_down_utilization} must be in (0, 1]")
        for name in ("tolerance", "scale_up_stabilization_s", "scale_down_stabilization_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.removesuffix('_s').replace('_', '-')} {getattr(self, name)} must be >= 0")
        if self.warmup_timeout_s <= 0:
            raise ValueError(f"--warmup-timeout {self.warmup_timeout_s} must be > 0: it is how long a starting "
                             "replica is waited for")

    def clamp(self, count: int) -> int:
        return min(max(count, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Decision:
    """What ``Autoscaler.decide`` asks of the provider; a hold has ``desired == current``."""

    desired: int
    current: int
    reason: str  # one human sentence, logged and exported

    @property
    def direction(self) -> str:
        if self.desired > self.current:
            return "up"
        return "down" if self.desired < self.current else "hold"


def recommend(loads: Sequence[ReplicaLoad], fleet: FleetState, policy: ScalingPolicy) -> tuple[int, str]:
    """The count the load asks for right now, with its reason (no windows, no cooldown), always
    within ``[policy.min_replicas, policy.max_replicas]``."""
    if loads:
        count, reason = _by_load(loads, fleet.current, policy)
    else:
        count, reason = fleet.current, "no ready replica reports load"
    clamped = policy.clamp(count)
    if fleet.current < policy.min_replicas:
        reason += f"; {_replicas(fleet.current)} below --min-replicas {policy.min_replicas} → {clamped}"
    elif fleet.current > policy.max_replicas:
        reason += f"; {_replicas(fleet.current)} above --max-replicas {policy.max_replicas} → {clamped}"
    elif clamped < count:
        reason += f", capped at --max-replicas {policy.max_replicas}"
    return clamped, reason


def _by_load(loads: Sequence[ReplicaLoad], current: int, policy: ScalingPolicy) -> tuple[int, str]:
    num_reports = len(loads)
    num_waiting = sum(load.num_waiting for load in loads)
    total_kv = sum(load.kv_usage for load in loads)  # in replicas' worth of KV cache
    waiting_per, kv = num_waiting / num_reports, total_kv / num_reports

    asks = []  # (count, reason) of each signal over its target
    if waiting_per > policy.target_waiting * (1 + policy.tolerance):
        by_queue = _ceil(num_waiting / policy.target_waiting)
        asks.append((by_queue, f"waiting {waiting_per:.1f}/replica > target {policy.target_waiting:g} "
                               f"→ {_replicas(by_queue)}"))
    if kv > policy.target_kv_usage * (1 + policy.tolerance):
        by_kv = _ceil(total_kv / policy.target_kv_usage)
        asks.append((by_kv, f"KV usage {kv:.0%} > target {policy.target_kv_usage:.0%} → {_replicas(by_kv)}"))
    asks = [(count, reason) for count, reason in asks if count > current]
    if asks:
        return max(count for count, _ in asks), " and ".join(reason for _, reason in asks)

    if num_waiting == 0:
        num_running = sum(load.num_running for load in loads)
        slots_per_replica = sum(load.max_num_seqs for load in loads) / num_reports
        for m in range(policy.min_replicas, current):
            num_slots = m * slots_per_replica
            fits_slots = num_running <= num_slots * policy.scale_down_utilization
            fits_kv = total_kv / m <= policy.target_kv_usage * policy.scale_down_utilization
            if fits_slots and fits_kv:
                return m, (f"load fits on {_replicas(m)} (running {num_running} of {num_slots:g} slots, "
                           f"KV {total_kv / m:.0%})")
    return current, f"within targets (waiting {waiting_per:.1f}/replica, KV usage {kv:.0%})"


def _ceil(x: float) -> int:
    """``ceil`` that ignores float noise: 3 * 0.9 / 0.9 may come out a hair above 3."""
    return math.ceil(x - 1e-9)


def _replicas(count: int) -> str:
    return f"{count} replica" if count == 1 else f"{count} replicas"


class Autoscaler:
    """Turns recommendations into decisions. Stateful: it keeps the recent recommendations (for the
    stabilization windows) and the time of its last action (for the cooldown), so the caller must
    scale the fleet to every non-hold ``Decision`` it gets, and call ``decide`` with a
    non-decreasing ``now``."""

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self._history: deque[tuple[float, int]] = deque()  # (now, recommendation), oldest first
        self._last_action: float | None = None

    def decide(self, now: float, loads: Sequence[ReplicaLoad], fleet: FleetState) -> Decision:
        """``now``: monotonic seconds; ``loads``: the ready replicas' latest reports."""
        policy = self.policy
        rec, reason = recommend(loads, fleet, policy)
        if fleet.current != policy.clamp(fleet.current):
            self._record(now, rec)
            return self._act(now, rec, fleet, reason)

        late = ""
        if fleet.ready < fleet.current and fleet.oldest_starting_s is not None:
            if fleet.oldest_starting_s < policy.warmup_timeout_s:
                return Decision(fleet.current, fleet.current,
                                f"waiting for {fleet.current - fleet.ready} starting replica(s) to become ready "
                                f"({fleet.oldest_starting_s:.0f} s)")
            late = (f"; a replica has been starting for {fleet.oldest_starting_s:.0f} s (over --warmup-timeout "
                    f"{policy.warmup_timeout_s:g}) and is no longer waited for")

        self._record(now, rec)
        desired = fleet.current
        if rec < fleet.current:
            window = policy.scale_down_stabilization_s
            peak = max(self._recent(now, window))
            desired = min(fleet.current, peak)
            if desired != rec:
                reason += f"; highest recommendation in the {window:g} s scale-down window is {peak} → {desired}"
        elif rec > fleet.current:
            window = policy.scale_up_stabilization_s
            low = min(self._recent(now, window))
            desired = max(fleet.current, low)
            if desired != rec:
                reason += f"; lowest recommendation in the {window:g} s scale-up window is {low} → {desired}"

        if desired != fleet.current and self._last_action is not None:
            ago = now - self._last_action
            if ago < policy.cooldown_s:
                return Decision(fleet.current, fleet.current,
                                f"cooldown: last scale action {ago:.0f} s ago (--cooldown {policy.cooldown_s:g}); "
                                f"wanted {desired}: {reason}{late}")
        return self._act(now, desired, fleet, reason + late)

    def _record(self, now: float, rec: int) -> None:
        self._history.append((now, rec))
        longest = max(self.policy.scale_up_stabilization_s, self.policy.scale_down_stabilization_s)
        while now - self._history[0][0] > longest:
            self._history.popleft()

    def _recent(self, now: float, window_s: float) -> list[int]:
        """The recommendations within ``window_s`` of ``now``; with a window of 0, just the latest."""
        if window_s == 0:
            return [self._history[-1][1]]
        return [rec for t, rec in self._history if now - t <= window_s]

    def _act(self, now: float, desired: int, fleet: FleetState, reason: str) -> Decision:
        if desired != fleet.current:
            self._last_action = now
        return Decision(desired, fleet.current, reason)
