"""Closed-loop driving metrics against hand-computed episodes (nuPlan, NAVSIM PDMS, CARLA driving score)."""

import math
import subprocess
import sys

import numpy as np
import pytest

from stack.errors import StackError
from stack.metrics.driving import (
    EpisodeTrace, _derivative, aggregate, boxes_overlap, collision_events, comfort_signals, pdm_score, score_episode,
    ttc_violations,
)

DT = 0.1
CAR = (4.5, 1.9)


def ego_path(steps, speed=10.0, x0=0.0, accel=None):
    """(S, 5) ego driving along +x; with accel (S,) the speed integrates it (explicit Euler)."""
    ego = np.zeros((steps, 5))
    if accel is None:
        ego[:, 0], ego[:, 3] = x0 + speed * DT * np.arange(steps), speed
        return ego
    speeds = speed + np.concatenate([[0.0], np.cumsum(accel[:-1]) * DT])
    ego[:, 0] = x0 + np.concatenate([[0.0], np.cumsum(speeds[:-1]) * DT])
    ego[:, 3], ego[:, 4] = speeds, accel
    return ego


def mover(steps, x0, y0, yaw, speed):
    """(S, 4) an agent at constant velocity along its yaw."""
    t = DT * np.arange(steps)
    return np.stack([x0 + speed * np.cos(yaw) * t, y0 + speed * np.sin(yaw) * t,
                     np.full(steps, yaw), np.full(steps, speed)], 1)


def make_trace(ego, agents=(), sizes=None, classes=None, static=None, route_length=100.0, on_drivable=None,
               progress=None, agent_valid=None):
    steps = len(ego)
    agents = np.stack(agents, 1) if len(agents) else np.zeros((steps, 0, 4))
    count = agents.shape[1]
    return EpisodeTrace(
        dt=DT, ego=ego, ego_size=CAR, agents=agents,
        agent_sizes=np.array(sizes if sizes is not None else [CAR] * count, dtype=float).reshape(count, 2),
        agent_classes=classes if classes is not None else ["car"] * count,
        agent_static=np.array(static if static is not None else [False] * count, dtype=bool),
        progress=ego[:, 0] - ego[0, 0] if progress is None else progress,
        route_length=route_length,
        on_drivable=np.ones(steps, bool) if on_drivable is None else on_drivable, agent_valid=agent_valid)


# ---------------------------------------------------------------------------------------------- geometry


def test_oriented_overlap_is_not_the_axis_aligned_one():
    diamond = [0.0, 0.0, math.pi / 4, 2.0, 2.0]                     # |x| + |y| <= 1.414
    assert not boxes_overlap(diamond, [2.3, 2.3, 0.0, 2.0, 2.0])    # bounding boxes overlap, the boxes do not
    assert not boxes_overlap([2.3, 2.3, 0.0, 2.0, 2.0], diamond)    # only the diamond's axes separate them
    assert boxes_overlap(diamond, [2.3, 0.0, 0.0, 2.0, 2.0])        # the diamond's corner (1.414, 0) is inside
    assert not boxes_overlap([0, 0, 0, 2, 2], [2, 0, 0, 2, 2])      # touching is not overlapping
    assert boxes_overlap([0.5, -1.0, 0.0, 0.0, 3.0], [0, 0, 0, 2, 2])  # a segment (zero length) through the box


def corners(box):
    x, y, yaw, length, width = box
    c, s = math.cos(yaw), math.sin(yaw)
    half = [(length / 2, width / 2), (-length / 2, width / 2), (-length / 2, -width / 2), (length / 2, -width / 2)]
    return [(x + c * u - s * v, y + s * u + c * v) for u, v in half]


def polygons_intersect(p, q):
    """Oracle without projections: an edge of one crosses an edge of the other, or one holds a corner of the other."""
    def orient(a, b, c):
        return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

    def crosses(a, b, c, d):
        return orient(a, b, c) * orient(a, b, d) < 0 and orient(c, d, a) * orient(c, d, b) < 0

    def inside(point, poly):
        signs = [orient(poly[i], poly[(i + 1) % 4], point) for i in range(4)]
        return all(sign > 0 for sign in signs) or all(sign < 0 for sign in signs)

    edges = lambda poly: [(poly[i], poly[(i + 1) % 4]) for i in range(4)]  # noqa: E731
    return (any(crosses(*e, *f) for e in edges(p) for f in edges(q))
            or any(inside(c, q) for c in p) or any(inside(c, p) for c in q))


def test_box_overlap_matches_a_polygon_oracle():
    rng = np.random.default_rng(7)
    a, b = (np.column_stack([rng.uniform(-4, 4, (2000, 2)), rng.uniform(-np.pi, np.pi, 2000),
                             rng.uniform(0.3, 6, (2000, 2))]) for _ in range(2))
    ours = boxes_overlap(a, b)
    oracle = np.array([polygons_intersect(corners(x), corners(y)) for x, y in zip(a, b)])
    assert 0.2 < ours.mean() < 0.8 and (ours == oracle).all()


def test_derivative_is_scipys_savitzky_golay():
    signal = pytest.importorskip("scipy.signal")
    values = np.random.default_rng(3).normal(size=37).cumsum()
    assert np.allclose(_derivative(values, DT), signal.savgol_filter(values, 5, 2, deriv=1, delta=DT))


# ---------------------------------------------------------------------------------------------- collisions


def test_head_on_is_one_at_fault_vehicle_collision():
    steps = 41
    oncoming = mover(steps, 60.0, 0.0, math.pi, 10.0)                # centres close at 2 m per step
    metrics = score_episode(make_trace(ego_path(steps), [oncoming]), expert_progress=40.0)
    # overlap when the centre gap 60 - 2k < 4.5: first at k = 28, t = 2.8 s; the boxes then pass through: one track
    assert metrics["collisions"] == 1 and metrics["collisions_vehicle"] == 1 and metrics["collisions_total"] == 1
    assert metrics["first_collision_s"] == pytest.approx(2.8)
    assert metrics["no_collision"] == 0 and metrics["pdms"] == 0
    assert metrics["route_completion"] == pytest.approx(0.4)          # 40 m of a 100 m route
    assert metrics["driving_score"] == pytest.approx(0.6 * 0.4)
    assert metrics["ttc"] == 0                                       # the approach was a TTC violation first


def test_rear_ended_is_not_at_fault_stopped_or_moving():
    steps = 40
    stopped = make_trace(ego_path(steps, speed=0.0), [mover(steps, -20.0, 0.0, 0.0, 8.0)])
    moving = make_trace(ego_path(steps, speed=2.0), [mover(steps, -20.0, 0.0, 0.0, 8.0)])
    assert [e["kind"] for e in collision_events(stopped)] == ["stopped_ego"]
    assert [e["kind"] for e in collision_events(moving)] == ["active_rear"]
    for trace in (stopped, moving):
        metrics = score_episode(trace, expert_progress=None)
        assert metrics["collisions"] == 0 and metrics["collisions_total"] == 1
        assert metrics["no_collision"] == 1 and math.isnan(metrics["first_collision_s"])
        assert metrics["driving_score"] == pytest.approx(metrics["route_completion"])
        assert metrics["ttc"] == 1                                   # a car closing from behind is not the ego's TTC


def test_side_swipe_by_the_ego_is_lateral_and_at_fault():
    steps = 20
    merging = mover(steps, 5.0, 4.0, -math.pi / 2, 2.0)              # lengthwise across; near edge y = 1.75 - 0.2 k
    events = collision_events(make_trace(ego_path(steps), [merging]))
    assert [(e["kind"], e["step"], e["at_fault"]) for e in events] == [("active_lateral", 5, True)]


def test_parked_car_collision_is_static():
    steps = 31
    parked = mover(steps, 25.0, 0.0, 0.0, 0.0)
    metrics = score_episode(make_trace(ego_path(steps), [parked], static=[True]), expert_progress=60.0)
    events = collision_events(make_trace(ego_path(steps), [parked], static=[True]))
    assert [e["kind"] for e in events] == ["stopped_track"]
    assert metrics["collisions_static"] == 1 and metrics["collisions_vehicle"] == 0
    assert metrics["no_collision"] == 0.5
    assert metrics["driving_score"] == pytest.approx(0.65 * 0.30)
    # TTC violated, comfortable, EP = 30 / 60: PDMS = 0.5 * 1 * (5*0 + 2*1 + 5*0.5) / 12
    assert metrics["pdms"] == pytest.approx(0.5 * (2 + 2.5) / 12)


def test_pedestrian_and_cyclist_collisions():
    steps = 31
    walker = mover(steps, 20.0, -3.0, math.pi / 2, 1.5)               # in the ego's lane when its front arrives
    metrics = score_episode(make_trace(ego_path(steps), [walker], sizes=[(0.5, 0.6)], classes=["pedestrian"]), None)
    assert metrics["collisions_pedestrian"] == 1 and metrics["no_collision"] == 0 and metrics["pdms"] == 0
    assert metrics["driving_score"] == pytest.approx(0.5 * 0.30)
    rider = mover(steps, 20.0, -3.0, math.pi / 2, 1.5)
    metrics = score_episode(make_trace(ego_path(steps), [rider], sizes=[(1.8, 0.6)], classes=["cyclist"]), None)
    assert metrics["collisions_cyclist"] == 1 and metrics["no_collision"] == 0
    assert metrics["driving_score"] == pytest.approx(0.6 * 0.30)      # CARLA counts bicycles as vehicles


def test_absent_agents_do_not_collide():
    steps = 41
    oncoming = mover(steps, 60.0, 0.0, math.pi, 10.0)                # overlaps the ego from step 28 to about 33
    valid = np.ones((steps, 1), bool)
    valid[20:35] = False                                             # despawned through the overlap
    oncoming[20:35] = np.nan
    trace = make_trace(ego_path(steps), [oncoming], agent_valid=valid)
    assert collision_events(trace) == [] and not ttc_violations(trace)[20:35].any()
    valid[30:35], oncoming[30:35] = True, mover(steps, 60.0, 0.0, math.pi, 10.0)[30:35]
    events = collision_events(make_trace(ego_path(steps), [oncoming], agent_valid=valid))
    assert [(e["step"], e["kind"]) for e in events] == [(30, "active_front")]


def test_penalties_multiply_over_tracks():
    steps = 41
    first, second = mover(steps, 20.0, 0.0, 0.0, 0.0), mover(steps, 35.0, 0.0, 0.0, 0.0)
    metrics = score_episode(make_trace(ego_path(steps), [first, second]), None)
    assert metrics["collisions"] == 2 and metrics["driving_score"] == pytest.approx(0.6 * 0.6 * 0.4)


# ---------------------------------------------------------------------------------------------- drivable area, TTC


def test_off_road_share_leaves_route_completion_and_fails_dac():
    steps = 101
    off = np.ones(steps, bool)
    off[41:61] = False                                               # 20 of the 100 one-metre steps
    metrics = score_episode(make_trace(ego_path(steps, speed=10.0), on_drivable=off), None)
    assert metrics["route_completion"] == pytest.approx(0.8)
    assert metrics["drivable_area_compliance"] == 0 and metrics["pdms"] == 0
    assert metrics["driving_score"] == pytest.approx(0.8)
    assert score_episode(make_trace(ego_path(steps, speed=10.0)), None)["route_completion"] == pytest.approx(1.0)


@pytest.mark.parametrize("gap, violates", [(5.0, True), (15.0, False)])
def test_ttc_closing_on_a_stopped_car(gap, violates):
    steps = 3                                                        # gap shrinks by 1 m a step, stays > 9.5 m at 15
    stopped = mover(steps, CAR[0] + gap, 0.0, 0.0, 0.0)             # bumper-to-bumper gap at step 0
    trace = make_trace(ego_path(steps), [stopped])
    assert bool(ttc_violations(trace)[0]) is violates
    assert score_episode(trace, None)["ttc"] == (0.0 if violates else 1.0)


def test_ttc_only_while_the_ego_moves():
    oncoming = mover(3, CAR[0] + 5.0, 0.0, math.pi, 10.0)            # would meet the ego in 0.5 s
    assert ttc_violations(make_trace(ego_path(3, speed=1.0), [oncoming]))[0]
    assert not ttc_violations(make_trace(ego_path(3, speed=0.0), [oncoming])).any()


# ---------------------------------------------------------------------------------------------- comfort


def braking(steps, peak, jerk=3.0):
    """Longitudinal accel ramping at `jerk` m/s^3 from 0 to -peak, then held."""
    return -np.minimum(jerk * DT * np.arange(steps), peak)


def test_comfort_hard_brake_fails_gentle_passes():
    hard = score_episode(make_trace(ego_path(30, speed=15.0, accel=braking(30, 6.0))), None)
    gentle = score_episode(make_trace(ego_path(30, speed=15.0, accel=braking(30, 2.0))), None)
    assert hard["comfort"] == 0 and hard["max_abs_accel"] == pytest.approx(6.0)
    assert gentle["comfort"] == 1 and gentle["max_abs_accel"] == pytest.approx(2.0)
    assert gentle["max_abs_jerk"] == pytest.approx(3.0, abs=1e-6)    # the ramp's slope, through the filter
    # the same 2 m/s^2 applied as a step is a 6 m/s^3 jerk in nuPlan's filter: over its 4.13 bound
    step = np.where(np.arange(30) >= 10, -2.0, 0.0)
    assert score_episode(make_trace(ego_path(30, speed=15.0, accel=step)), None)["comfort"] == 0


def test_comfort_lateral_acceleration_in_a_turn():
    steps, speed = 30, 10.0
    for yaw_rate, comfortable in ((0.3, 1.0), (0.6, 0.0)):            # lat accel 3 vs 6 m/s^2 (bound 4.89)
        ego = ego_path(steps, speed=speed)
        ego[:, 2] = yaw_rate * DT * np.arange(steps)
        trace = make_trace(ego)
        assert np.allclose(comfort_signals(trace)["lat_accel"], speed * yaw_rate)
        assert score_episode(trace, None)["comfort"] == comfortable


# ---------------------------------------------------------------------------------------------- EP, PDMS


def test_ego_progress_clip_and_five_metre_rule():
    trace = make_trace(ego_path(41))                                 # 40 m
    assert score_episode(trace, expert_progress=50.0)["ego_progress"] == pytest.approx(0.8)
    assert score_episode(trace, expert_progress=20.0)["ego_progress"] == 1.0
    assert score_episode(trace, expert_progress=4.0)["ego_progress"] == 1.0   # expert under 5 m: EP = 1
    crawl = make_trace(ego_path(11, speed=1.0))                      # 1 m
    assert score_episode(crawl, expert_progress=4.0)["ego_progress"] == 1.0   # not 0.25
    assert score_episode(crawl, expert_progress=5.0)["ego_progress"] == pytest.approx(0.2)
    assert score_episode(trace, expert_progress=None)["ego_progress"] == pytest.approx(0.4)  # route_length 100
    backwards = make_trace(ego_path(11, speed=0.0), progress=-np.linspace(0, 3, 11))
    assert score_episode(backwards, expert_progress=30.0)["ego_progress"] == 0.0


def test_pdms_formula():
    assert pdm_score(1, 1, 0, 1, 0.5) == pytest.approx((0 + 2 + 2.5) / 12)
    assert pdm_score(0.5, 1, 1, 0, 1) == pytest.approx(0.5 * 10 / 12)
    assert pdm_score(1, 0, 1, 1, 1) == 0
    clean = score_episode(make_trace(ego_path(41)), expert_progress=50.0)   # TTC 1, C 1, EP 0.8
    assert clean["pdms"] == pytest.approx((5 + 2 + 5 * 0.8) / 12)


# ---------------------------------------------------------------------------------------------- aggregate


def row(policy, family, seed, pdms, first=float("nan")):
    return {"policy": policy, "family": family, "seed": seed, "metrics": {"pdms": pdms, "first_collision_s": first}}


def test_aggregate_mean_and_std_over_seeds_of_per_seed_means():
    rows = [row("net", "a", 0, 0.2, 1.0), row("net", "a", 0, 0.4), row("net", "a", 1, 0.6, 3.0),
            row("net", "b", 0, 1.0), row("net", "b", 1, 0.0, 2.0), row("net", "b", 1, 0.5),
            row("expert", "a", 0, 1.0)]
    summary = aggregate(rows)
    a, b, whole = summary["net"]["a"]["pdms"], summary["net"]["b"]["pdms"], summary["net"]["all"]["pdms"]
    assert (a["mean"], a["std"], a["episodes"]) == pytest.approx((0.45, 0.3 / math.sqrt(2), 3))
    assert (b["mean"], b["std"], b["episodes"]) == pytest.approx((0.625, 0.75 / math.sqrt(2), 3))
    # all: seed 0 (0.2 + 0.4 + 1.0) / 3, seed 1 (0.6 + 0.0 + 0.5) / 3
    seed0, seed1 = 1.6 / 3, 1.1 / 3
    expected = ((seed0 + seed1) / 2, abs(seed0 - seed1) / math.sqrt(2), 6)
    assert (whole["mean"], whole["std"], whole["episodes"]) == pytest.approx(expected)
    # NaN (no collision) stays out of a seed's mean: seed 0 -> 1.0, seed 1 -> 2.5
    assert summary["net"]["all"]["first_collision_s"]["mean"] == pytest.approx(1.75)
    expert = summary["expert"]["a"]["pdms"]
    assert expert["mean"] == 1.0 and math.isnan(expert["std"]) and expert["episodes"] == 1
    assert set(summary["net"]) == {"a", "b", "all"}


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_traces_name_the_field():
    good = make_trace(ego_path(10), [mover(10, 30.0, 0.0, 0.0, 0.0)])
    fields = dict(dt=DT, ego=good.ego, ego_size=CAR, agents=good.agents, agent_sizes=good.agent_sizes,
                  agent_classes=["car"], agent_static=good.agent_static, progress=good.progress,
                  route_length=100.0, on_drivable=good.on_drivable)
    nan_ego = good.ego.copy()
    nan_ego[3, 1] = np.nan
    cases = {"agents": good.agents[:9], "ego": nan_ego, "agent_classes": ["bus"], "progress": good.progress[:5],
             "on_drivable": np.ones(9, bool), "agent_sizes": np.zeros((1, 2)), "dt": 0.0, "route_length": float("nan")}
    for field, value in cases.items():
        with pytest.raises(StackError, match=rf"EpisodeTrace\.{field}: expected"):
            EpisodeTrace(**{**fields, field: value})
    negative = good.ego.copy()
    negative[0, 3] = -1.0
    with pytest.raises(StackError, match=r"EpisodeTrace\.ego: expected speed"):
        EpisodeTrace(**{**fields, "ego": negative})
    with pytest.raises(StackError, match=r"EpisodeTrace\.agents: expected speed"):
        EpisodeTrace(**{**fields, "agents": good.agents - [0.0, 0.0, 0.0, 1.0]})
    with pytest.raises(StackError, match=r"EpisodeTrace\.agents: expected finite"):   # NaN where the agent exists
        EpisodeTrace(**{**fields, "agents": np.where(np.arange(10)[:, None, None] == 4, np.nan, good.agents)})
    with pytest.raises(StackError, match=r"EpisodeTrace\.agent_valid: expected"):
        EpisodeTrace(**{**fields, "agent_valid": np.ones((10, 2), bool)})
    with pytest.raises(StackError, match="lacks"):
        aggregate([{"policy": "net", "family": "a", "metrics": {}}])


def test_scoring_imports_no_torch():
    probe = "import sys, stack.metrics.driving; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_the_minimum_speed_penalty_follows_carla_against_the_expert():
    """CARLA 2.0: penalty 0.7 + 0.3 x (ego speed / reference speed) below 100 %; the expert's speed is ours."""
    from stack.metrics.driving import EpisodeTrace, min_speed_penalty, score_episode

    steps, dt = 41, 0.1
    x = np.linspace(0.0, 20.0, steps)  # 20 m in 4 s: 5 m/s
    ego = np.stack([x, np.zeros(steps), np.zeros(steps), np.full(steps, 5.0), np.zeros(steps)], 1)
    trace = EpisodeTrace(dt=dt, ego=ego, ego_size=(4.5, 1.9), agents=np.zeros((steps, 0, 4)),
                         agent_sizes=np.zeros((0, 2)), agent_classes=[], agent_static=np.zeros(0, bool),
                         progress=x, route_length=40.0, on_drivable=np.ones(steps, bool))
    ratio, penalty = min_speed_penalty(trace, expert_progress=40.0, expert_seconds=4.0)  # the expert did 10 m/s
    assert ratio == pytest.approx(0.5) and penalty == pytest.approx(0.85)
    assert min_speed_penalty(trace, 20.0, 4.0) == (pytest.approx(1.0), 1.0)
    assert np.isnan(min_speed_penalty(trace, 3.0, 4.0)[0]), "an expert that barely moves is no reference"
    scored = score_episode(trace, 40.0, 4.0)
    assert scored["driving_score"] == pytest.approx(scored["route_completion"] * 0.85)
    assert score_episode(trace, 40.0)["driving_score"] == pytest.approx(scored["route_completion"])


def test_a_trace_says_why_it_ended_or_is_refused():
    from stack.errors import StackError
    from stack.metrics.driving import EpisodeTrace

    with pytest.raises(StackError, match="EpisodeTrace.ended"):
        EpisodeTrace(dt=0.1, ego=np.zeros((2, 5)), ego_size=(4.5, 1.9), agents=np.zeros((2, 0, 4)),
                     agent_sizes=np.zeros((0, 2)), agent_classes=[], agent_static=np.zeros(0, bool),
                     progress=np.zeros(2), route_length=10.0, on_drivable=np.ones(2, bool), ended="crashed")


def _bar_rows(gains: dict, episodes: int = 20, noise: float = 0.05, seed: int = 0) -> list:
    """Rows of a network and the blind policies on `episodes` shared episodes: baseline scores random, the
    network's = a blind policy's + its gain + noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(episodes):
        base = {m: rng.uniform(0.2, 0.7) for m in ("driving_score", "pdms")}
        for policy in ("constant_velocity", "ego_rollout"):
            rows.append({"policy": policy, "family": "route", "seed": 0, "index": index, "metrics": dict(base)})
        rows.append({"policy": "net", "family": "route", "seed": 0, "index": index,
                     "metrics": {m: base[m] + gains[m] + rng.normal(0, noise) for m in base}})
    return rows


def test_the_closed_loop_bar_passes_a_clear_gain_and_fails_a_tie_or_a_loss():
    from stack.metrics.driving import closed_loop_bar, paired_gain

    clear = closed_loop_bar(_bar_rows({"driving_score": 0.2, "pdms": 0.15}), "net")
    assert clear["passed"] is True and len(clear["comparisons"]) == 4
    assert all(c["low"] > 0 and c["low"] <= c["gain"] <= c["high"] for c in clear["comparisons"])
    tie = closed_loop_bar(_bar_rows({"driving_score": 0.2, "pdms": 0.0}, noise=0.2), "net")
    assert tie["passed"] is False, "no PDMS gain: the interval must reach below zero"
    assert closed_loop_bar(_bar_rows({"driving_score": -0.1, "pdms": 0.3}), "net")["passed"] is False
    assert closed_loop_bar([r for r in _bar_rows({"driving_score": 1, "pdms": 1}) if r["policy"] == "net"],
                           "net")["passed"] is None, "no blind policy driven: nothing to judge by"
    # pairs are episodes: shuffling the rows does not change the gain, dropping the baseline's episodes does
    rows = _bar_rows({"driving_score": 0.2, "pdms": 0.15})
    gain = paired_gain(rows, "net", "ego_rollout", "pdms")
    assert paired_gain(rows[::-1], "net", "ego_rollout", "pdms")["gain"] == pytest.approx(gain["gain"])
    fewer = [r for r in rows if not (r["policy"] == "ego_rollout" and r["index"] >= 10)]
    assert paired_gain(fewer, "net", "ego_rollout", "pdms")["episodes"] == 10
    with pytest.raises(StackError, match="no episode in common"):
        paired_gain(rows, "net", "expert", "pdms")


def test_bootstrap_mean_interval_holds_the_mean_and_narrows_with_more_episodes():
    from stack.metrics.driving import bootstrap_mean

    rng = np.random.default_rng(3)
    few, many = bootstrap_mean(rng.uniform(0, 1, 10)), bootstrap_mean(rng.uniform(0, 1, 400))
    assert few["low"] < few["mean"] < few["high"] and many["low"] < many["mean"] < many["high"]
    assert many["high"] - many["low"] < (few["high"] - few["low"]) / 3
    assert bootstrap_mean([0.7] * 5) == {"mean": 0.7, "low": pytest.approx(0.7), "high": pytest.approx(0.7),
                                         "episodes": 5, "level": 0.9}
    with pytest.raises(StackError, match="no episodes"):
        bootstrap_mean([])
