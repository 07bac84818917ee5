"""The autoscaler's decisions: ``recommend`` on single load snapshots (exact counts and reasons),
and ``Autoscaler.decide`` on recorded load series replayed tick by tick against a simulated fleet
(replicas ready after a warm-up, removed at once), checking the windows, cooldown and warm-up wait."""

from dataclasses import dataclass, field

import pytest

from services.autoscaler.decision import Autoscaler, Decision, ReplicaLoad, ScalingPolicy, recommend
from services.autoscaler.provider import FleetState

SLOTS = 8  # each simulated replica's max_num_seqs


def load(num_running=0, num_waiting=0, kv_usage=0.0, max_num_seqs=SLOTS, replica_id="r"):
    return ReplicaLoad(replica_id, num_running, num_waiting, kv_usage, max_num_seqs)


def spread(num_requests: int, num_ready: int, kv_per_request: float) -> list[ReplicaLoad]:
    """``num_requests`` in the system, spread evenly over the ready replicas: each runs up to
    ``SLOTS``, the rest wait; KV usage grows with what runs."""
    loads = []
    for i in range(num_ready):
        mine = num_requests // num_ready + (i < num_requests % num_ready)
        running = min(mine, SLOTS)
        loads.append(load(running, mine - running, min(1.0, running * kv_per_request), replica_id=f"r{i}"))
    return loads


@dataclass
class SimulatedFleet:
    """A provider's fleet: ``scale_to`` up adds replicas that are ready ``warmup_ticks`` later
    (never, with None); ``scale_to`` down removes replicas at once, starting ones first."""

    num_ready: int
    warmup_ticks: int | None
    started_at: list[int] = field(default_factory=list)  # the tick each starting replica started

    def advance(self, tick: int) -> None:
        if self.warmup_ticks is not None:
            done = [t for t in self.started_at if tick - t >= self.warmup_ticks]
            self.num_ready += len(done)
            self.started_at = [t for t in self.started_at if tick - t < self.warmup_ticks]

    def state(self, tick: int, tick_s: float) -> FleetState:
        oldest = (tick - min(self.started_at)) * tick_s if self.started_at else None
        return FleetState(self.num_ready + len(self.started_at), self.num_ready, oldest)

    def scale_to(self, count: int, tick: int) -> None:
        current = self.num_ready + len(self.started_at)
        if count > current:
            self.started_at += [tick] * (count - current)
        else:
            num_gone = current - count
            num_from_starting = min(num_gone, len(self.started_at))
            self.started_at = self.started_at[num_from_starting:]
            self.num_ready -= num_gone - num_from_starting


@dataclass
class Tick:
    now: float
    fleet: FleetState
    decision: Decision


def replay(policy: ScalingPolicy, demand: list[int], *, tick_s: float = 5.0, warmup_ticks: int | None = 2,
           kv_per_request: float = 0.05, start_replicas: int = 1) -> list[Tick]:
    """Replays ``demand`` (requests in the system at each tick) through an ``Autoscaler`` driving a
    ``SimulatedFleet`` that starts with ``start_replicas`` ready."""
    autoscaler, fleet = Autoscaler(policy), SimulatedFleet(start_replicas, warmup_ticks)
    ticks = []
    for tick, num_requests in enumerate(demand):
        fleet.advance(tick)
        state = fleet.state(tick, tick_s)
        decision = autoscaler.decide(tick * tick_s, spread(num_requests, state.ready, kv_per_request), state)
        assert decision.current == state.current
        assert policy.min_replicas <= decision.desired <= policy.max_replicas
        if decision.direction != "hold":
            fleet.scale_to(decision.desired, tick)
        ticks.append(Tick(tick * tick_s, state, decision))
    return ticks


def actions(ticks: list[Tick]) -> list[Tick]:
    return [t for t in ticks if t.decision.direction != "hold"]


# recommend: one snapshot


def test_queue_over_target_asks_for_waiting_over_target_replicas():
    fleet = FleetState(current=2, ready=2)
    count, reason = recommend([load(8, 5), load(8, 3)], fleet, ScalingPolicy())
    assert count == 4  # 8 waiting / target 2
    assert reason == "waiting 4.0/replica > target 2 → 4 replicas"


def test_no_scale_up_within_tolerance():
    fleet = FleetState(current=1, ready=1)
    policy = ScalingPolicy(target_waiting=10.0, tolerance=0.1, max_replicas=8)
    assert recommend([load(8, 11)], fleet, policy)[0] == 1  # 11 / 10 = 1.1: inside the tolerance
    assert recommend([load(8, 12)], fleet, policy)[0] == 2


def test_kv_pressure_alone_scales_up_without_a_queue():
    fleet = FleetState(current=1, ready=1)
    count, reason = recommend([load(7, 0, kv_usage=0.98)], fleet, ScalingPolicy())
    assert count == 2 and reason.startswith("KV usage 98% > target 80%")


def test_both_signals_take_the_larger_and_a_cap_is_said():
    fleet = FleetState(current=2, ready=2)
    loads = [load(8, 3, kv_usage=1.0), load(8, 3, kv_usage=1.0)]  # queue asks 3, KV asks 3 (2 / 0.8)
    assert recommend(loads, fleet, ScalingPolicy(target_kv_usage=0.5))[0] == 4  # KV: 2 / 0.5
    count, reason = recommend([load(8, 40), load(8, 40)], fleet, ScalingPolicy(max_replicas=4))
    assert count == 4 and reason.endswith("→ 40 replicas, capped at --max-replicas 4")


def test_scale_down_to_the_fewest_replicas_the_load_fits_on():
    fleet = FleetState(current=4, ready=4)
    by_slots = [load(3, 0, kv_usage=0.1)] * 4  # 12 running fit on 3 × 8 × 0.5 slots, not 2
    count, reason = recommend(by_slots, fleet, ScalingPolicy())
    assert count == 3 and reason == "load fits on 3 replicas (running 12 of 24 slots, KV 13%)"
    by_kv = [load(1, 0, kv_usage=0.25)] * 4  # slots fit on 1, but KV 1.0 / m <= 0.4 needs m = 3
    assert recommend(by_kv, fleet, ScalingPolicy())[0] == 3
    idle = [load(0, 0, kv_usage=0.0)] * 4
    assert recommend(idle, fleet, ScalingPolicy(min_replicas=2))[0] == 2


def test_scale_down_is_blocked_while_any_request_waits():
    fleet = FleetState(current=4, ready=4)
    idle = [load(1, 0, kv_usage=0.05)] * 4
    assert recommend(idle, fleet, ScalingPolicy())[0] == 1
    one_waits = idle[:3] + [load(1, 1, kv_usage=0.05)]
    count, reason = recommend(one_waits, fleet, ScalingPolicy())
    assert count == 4 and reason.startswith("within targets")
    autoscaler = Autoscaler(ScalingPolicy())
    decisions = [autoscaler.decide(float(now), one_waits, fleet) for now in range(0, 300, 5)]
    assert all(d.direction == "hold" for d in decisions)


def test_recommendation_is_clamped_to_min_and_max():
    policy = ScalingPolicy(min_replicas=2, max_replicas=4)
    assert recommend([], FleetState(0, 0), policy) == (
        2, "no ready replica reports load; 0 replicas below --min-replicas 2 → 2")
    assert recommend([], FleetState(6, 6), policy) == (
        4, "no ready replica reports load; 6 replicas above --max-replicas 4 → 4")
    assert recommend([], FleetState(3, 3), policy) == (3, "no ready replica reports load")
    idle = [load(0, 0)] * 6
    assert recommend(idle, FleetState(6, 6), policy)[0] == 2  # fits on 1, but not below --min-replicas


def test_out_of_range_fleet_is_brought_in_at_once_despite_cooldown_and_warmup():
    autoscaler = Autoscaler(ScalingPolicy(min_replicas=1, max_replicas=4, cooldown_s=30.0))
    first = autoscaler.decide(0.0, [], FleetState(current=0, ready=0))
    assert (first.desired, first.direction) == (1, "up")
    # 1 s later, still in cooldown and with a replica starting: an out-of-range fleet is not held
    second = autoscaler.decide(1.0, [load(0, 0)] * 5, FleetState(current=6, ready=5, oldest_starting_s=1.0))
    assert second.desired <= 4 and second.direction == "down"
    assert "above --max-replicas 4" in second.reason


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_replicas=0), "--min-replicas 0 must be at least 1"),
    (dict(min_replicas=3, max_replicas=2), "--max-replicas 2 is below --min-replicas 3"),
    (dict(target_waiting=0), "--target-waiting 0 must be > 0"),
    (dict(target_kv_usage=0.0), "--target-kv-usage"),
    (dict(target_kv_usage=1.5), "--target-kv-usage"),
    (dict(scale_down_utilization=0.0), "--scale-down-utilization"),
    (dict(scale_down_utilization=1.2), "--scale-down-utilization"),
    (dict(tolerance=-0.1), "--tolerance"),
    (dict(scale_up_stabilization_s=-1.0), "--scale-up-stabilization"),
    (dict(scale_down_stabilization_s=-1.0), "--scale-down-stabilization"),
    (dict(cooldown_s=-1.0), "--cooldown"),
    (dict(warmup_timeout_s=0.0), "--warmup-timeout"),
])
def test_policy_rejects_invalid_settings_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScalingPolicy(**kwargs)


def test_decision_direction():
    assert Decision(3, 2, "").direction == "up"
    assert Decision(1, 2, "").direction == "down"
    assert Decision(2, 2, "").direction == "hold"


# Autoscaler.decide: load series replayed tick by tick


def test_ramp_grows_while_the_queue_is_long_and_shrinks_to_min_after_the_down_window():
    policy = ScalingPolicy(max_replicas=4, scale_down_stabilization_s=60.0, cooldown_s=30.0)
    low, high, after = [2] * 10, [40] * 30, [0] * 30  # 5 s ticks
    ticks = replay(policy, low + high + after)
    high_ticks = ticks[len(low):len(low) + len(high)]
    assert max(t.decision.desired for t in high_ticks) >= 2
    assert all(t.decision.direction != "down" for t in high_ticks)
    assert all(t.decision.direction == "hold" for t in ticks[:len(low)])  # low load: 1 replica is enough
    last_high_s = high_ticks[-1].now
    downs = [t for t in actions(ticks) if t.decision.direction == "down"]
    assert downs and downs[0].now - last_high_s >= policy.scale_down_stabilization_s
    assert ticks[-1].fleet.current == policy.min_replicas


def test_one_tick_spike_is_ignored_with_a_scale_up_window():
    spike = [2] * 5 + [40] + [2] * 20
    ticks = replay(ScalingPolicy(scale_up_stabilization_s=10.0), spike, tick_s=1.0)
    assert actions(ticks) == []
    assert "lowest recommendation in the 10 s scale-up window is 1 → 1" in ticks[5].decision.reason


def test_one_tick_spike_scales_up_without_a_scale_up_window():
    spike = [2] * 5 + [40] + [2] * 20
    ticks = replay(ScalingPolicy(scale_up_stabilization_s=0.0), spike, tick_s=1.0)
    assert [(t.now, t.decision.direction) for t in actions(ticks)][0] == (5.0, "up")


def test_flapping_load_never_shrinks_then_grows_within_the_down_window():
    policy = ScalingPolicy(max_replicas=8, scale_down_stabilization_s=60.0, cooldown_s=30.0)
    flapping = [40, 0] * 60 + [0] * 30  # 5 s ticks: 10 minutes of flapping, then quiet
    ticks = replay(policy, flapping)
    done = actions(ticks)
    duration_s = ticks[-1].now - ticks[0].now
    assert len(done) <= 1 + duration_s / policy.cooldown_s
    assert all(b.now - a.now >= policy.cooldown_s for a, b in zip(done, done[1:]))
    for i, down in enumerate(done):
        if down.decision.direction == "down":
            assert all(later.decision.direction != "up" for later in done[i + 1:]
                       if later.now - down.now <= policy.scale_down_stabilization_s)
    assert all(t.decision.direction != "down" for t in ticks[:120])  # the load came back within every window
    assert ticks[-1].fleet.current == 1


def test_flapping_load_without_a_down_window_is_bounded_by_the_cooldown():
    policy = ScalingPolicy(max_replicas=8, scale_down_stabilization_s=0.0, cooldown_s=30.0)
    ticks = replay(policy, [40, 0] * 60, warmup_ticks=1)
    done = actions(ticks)
    assert len(done) >= 4  # it does follow the load, with no window to stop it
    assert all(b.now - a.now >= policy.cooldown_s for a, b in zip(done, done[1:]))
    assert any(t.decision.reason.startswith("cooldown: last scale action") for t in ticks)


def test_a_replica_that_never_becomes_ready_blocks_decisions_until_the_warmup_timeout():
    policy = ScalingPolicy(max_replicas=8, warmup_timeout_s=60.0, cooldown_s=30.0)
    demand = [13] * 3 + [40] * 12  # 10 s ticks; 13 on one replica: 5 waiting → 3 replicas
    ticks = replay(policy, demand, tick_s=10.0, warmup_ticks=None)
    assert (ticks[0].decision.direction, ticks[0].decision.desired) == ("up", 3)
    for t in ticks[1:6]:  # starting for 10 .. 50 s: held, though the load grows from tick 3
        assert t.decision.direction == "hold"
        assert t.decision.reason.startswith("waiting for 2 starting replica(s) to become ready")
    resumed = ticks[6]  # starting for 60 s: no longer waited for
    assert (resumed.decision.direction, resumed.decision.desired) == ("up", 8)
    assert "a replica has been starting for 60 s" in resumed.decision.reason
    assert "capped at --max-replicas 8" in resumed.decision.reason
    assert all(t.decision.desired <= policy.max_replicas for t in ticks)
    assert all(t.decision.direction == "hold" for t in ticks[7:])


def test_kv_pressure_alone_grows_the_fleet_in_a_replay():
    ticks = replay(ScalingPolicy(), [2] * 4 + [7] * 20, tick_s=5.0, kv_per_request=0.14)  # 7 × 0.14 = 98% KV
    assert all(report.num_waiting == 0 for t in ticks for report in spread(7, t.fleet.ready, 0.14))
    ups = [t for t in actions(ticks) if t.decision.direction == "up"]
    assert ups and ups[0].now == 20.0 and ups[0].decision.desired == 2
    assert ups[0].decision.reason.startswith("KV usage 98% > target 80%")
    assert ticks[-1].fleet.current == 2  # 2 replicas at 49%: stays (7 running do not fit on 1 at 50% of 8)
