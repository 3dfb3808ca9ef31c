"""The ego vehicle and its plan tracker: tracking accuracy, stops, limits, stale plans, determinism.

Plans are produced the way the closed loop produces them: T = 6 waypoints at 0.5 s, made
from the car's state at planning time, replanned at 2 Hz, delivered after a latency.
"""

import math

import numpy as np
import pytest

from stack.sim.vehicle import PlanTracker, VehicleLimits, VehicleState, step_bicycle

DT = 0.1
WAYPOINTS = 6
STEP_S = 0.5


def _plan_times(made_at):
    return made_at + STEP_S * np.arange(1, WAYPOINTS + 1)


def straight_plan(speed, lateral=0.0):
    """Along y = lateral at a constant speed, starting at the car's projection on that line."""
    def plan(state, made_at):
        s = state.x + speed * STEP_S * np.arange(1, WAYPOINTS + 1)
        return np.stack([s, np.full(WAYPOINTS, lateral)], axis=1), _plan_times(made_at)
    return plan


def arc_plan(speed, radius):
    """A left turn on the circle of this radius centred at (0, radius), from the car's angle on it."""
    def plan(state, made_at):
        angle = math.atan2(state.x, radius - state.y) + speed * STEP_S * np.arange(1, WAYPOINTS + 1) / radius
        return np.stack([radius * np.sin(angle), radius - radius * np.cos(angle)], axis=1), _plan_times(made_at)
    return plan


def stop_plan(stop_x, decel):
    """Keep the speed, then brake at `decel` to rest at x = stop_x (harder if it is already too close), as an expert plans a stop line."""
    def plan(state, made_at):
        to_go = max(stop_x - state.x, 0.0)
        v = state.speed
        if to_go < 1e-6 or v < 1e-6:
            return np.tile([stop_x if to_go < 1e-6 else state.x, 0.0], (WAYPOINTS, 1)), _plan_times(made_at)
        a = max(decel, v ** 2 / (2 * to_go))
        cruise_s = max(to_go - v ** 2 / (2 * a), 0.0) / v
        t = STEP_S * np.arange(1, WAYPOINTS + 1)
        braking = np.clip(t - cruise_s, 0.0, v / a)
        covered = np.minimum(v * np.minimum(t, cruise_s) + v * braking - 0.5 * a * braking ** 2, to_go)
        return np.stack([state.x + covered, np.zeros(WAYPOINTS)], axis=1), _plan_times(made_at)
    return plan


def accelerating_plan(accel, top):
    """From the car's speed at `accel` up to `top`, straight along x."""
    def plan(state, made_at):
        t = STEP_S * np.arange(1, WAYPOINTS + 1)
        ramp = min(max(top - state.speed, 0.0) / accel, t[-1])
        covered = state.speed * t + 0.5 * accel * np.minimum(t, ramp) ** 2 + accel * ramp * np.maximum(t - ramp, 0.0)
        return np.stack([state.x + covered, np.zeros(WAYPOINTS)], axis=1), _plan_times(made_at)
    return plan


def drive(plan_fn, state, seconds, replan_s=0.5, latency_s=0.0, limits=VehicleLimits(), dt=DT):
    """Run the loop; returns (states (S+1,6) x, y, yaw, speed, accel, steer, raw commands (S,2)).

    A plan made at t is followed from t + latency_s on; the car starts with a fresh plan (made at 0).
    """
    tracker = PlanTracker(limits, dt=dt)
    pending, current = [], plan_fn(state, 0.0)
    states, commands = [state], []
    replan_every = int(round(replan_s / dt))
    for step in range(int(round(seconds / dt))):
        now = step * dt
        if step % replan_every == 0:
            pending.append((now + latency_s, plan_fn(state, now)))
        while pending and pending[0][0] <= now + 1e-9:
            current = pending.pop(0)[1]
        accel, steer = tracker.command(state, current[0], current[1], now)
        commands.append((accel, steer))
        state = step_bicycle(state, accel, steer, dt, limits)
        states.append(state)
    table = np.array([[s.x, s.y, s.yaw, s.speed, s.accel, s.steer] for s in states])
    return table, np.array(commands)


def settle_time(errors_ok):
    """First time (s) after which every step is within tolerance."""
    bad = np.flatnonzero(~errors_ok)
    return 0.0 if not len(bad) else (bad[-1] + 1) * DT


def stand_still(state, made_at):
    """Every waypoint on the car: stop here, now."""
    return np.tile([state.x, state.y], (WAYPOINTS, 1)), _plan_times(made_at)


def step_changes(state, made_at):
    """5 m/s straight; from 2 s: 15 m/s, 3.5 m to the left (a lane change asked for at once); from 9 s: stop now."""
    if made_at < 2.0:
        return straight_plan(5.0)(state, made_at)
    if made_at < 9.0:
        return straight_plan(15.0, lateral=3.5)(state, made_at)
    return stand_still(state, made_at)


def _jerk(table):
    return np.diff(table[:, 4]) / DT


# --- the bicycle ---------------------------------------------------------------------------------------------------

def test_bicycle_drives_the_circle_its_steering_angle_sets():
    limits = VehicleLimits()
    state = VehicleState(0.0, 0.0, 0.0, 5.0, steer=0.3)
    centre = np.array([0.0, limits.wheelbase / math.tan(0.3)])  # rear axle turns about a point on its own axis
    for _ in range(200):
        state = step_bicycle(state, 0.0, 0.3, DT, limits)
        assert abs(np.hypot(state.x - centre[0], state.y - centre[1]) - centre[1]) < 1e-9
    assert state.speed == 5.0
    assert state.yaw == pytest.approx(5.0 * 20.0 * math.tan(0.3) / limits.wheelbase)


def test_bicycle_applies_every_limit_to_impossible_commands():
    limits = VehicleLimits()
    state = VehicleState(0.0, 0.0, 0.0, 10.0, accel=0.0, steer=0.0)
    after = step_bicycle(state, 50.0, 2.0, DT, limits)
    assert after.accel == pytest.approx(limits.max_jerk * DT)  # the jerk limit, not the +50 asked for
    assert after.steer == pytest.approx(limits.max_steer_rate * DT)
    for _ in range(30):
        after = step_bicycle(after, 50.0, 2.0, DT, limits)
    assert after.accel == pytest.approx(limits.max_accel)
    assert after.steer == pytest.approx(limits.max_steer)
    for _ in range(60):
        after = step_bicycle(after, -50.0, -2.0, DT, limits)
    assert after.speed == 0.0  # 10 m/s + a few seconds of full braking: stopped, not reversing
    assert after.steer == pytest.approx(-limits.max_steer)


def test_bicycle_stops_inside_the_step_and_never_reverses():
    state = VehicleState(0.0, 0.0, 0.0, 0.4, accel=-8.0)
    after = step_bicycle(state, -8.0, 0.0, DT)
    assert after.speed == 0.0
    assert after.x == pytest.approx(0.4 ** 2 / (2 * 8.0))  # moved only until it came to rest
    assert after.accel == pytest.approx(-0.4 / DT)
    held = step_bicycle(after, -8.0, 0.0, DT)
    assert (held.x, held.speed, held.accel) == (after.x, 0.0, 0.0)


@pytest.mark.parametrize("bad", [{"wheelbase": 0.0}, {"max_brake": -8.0}, {"max_jerk": math.inf}])
def test_limits_refuse_non_positive_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        VehicleLimits(**bad)


# --- the tracker -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("latency_s", [0.0, 1.0])
def test_straight_plan_at_10_mps_is_tracked_after_settling(latency_s):
    # starts 1 m to the side, 0.1 rad off and 2 m/s slow
    table, _ = drive(straight_plan(10.0), VehicleState(0.0, 1.0, 0.1, 8.0), 15.0, latency_s=latency_s)
    within = (np.abs(table[:, 1]) < 0.3) & (np.abs(table[:, 3] - 10.0) < 0.5)
    assert settle_time(within) <= 3.0  # measured 1.3 s fresh, 2.7 s with 1 s latency
    settled = table[int(8.0 / DT):]
    assert np.abs(settled[:, 1]).max() < 0.05  # measured 1e-5 m
    assert np.abs(settled[:, 3] - 10.0).max() < 0.05  # measured 1e-7 m/s fresh, 0.006 m/s with 1 s latency


@pytest.mark.parametrize("latency_s", [0.0, 1.0])
def test_left_turn_arc_of_radius_15_m_is_tracked_within_half_a_metre(latency_s):
    radius, speed = 15.0, 6.0  # 2.4 m/s^2 lateral: a junction turn
    table, _ = drive(arc_plan(speed, radius), VehicleState(0.0, 0.0, 0.0, speed), 12.0, latency_s=latency_s)
    off_arc = np.abs(np.hypot(table[:, 0], table[:, 1] - radius) - radius)
    assert off_arc.max() < 0.5  # measured 0.12 m (the turn-in, steering at its rate limit)
    assert off_arc[int(3.0 / DT):].max() < 0.1  # measured 0.05 m: the 3 m chords of the 0.5 s waypoints
    assert np.abs(table[int(2.0 / DT):, 3] - speed).max() < 0.5
    assert table[-1, 2] > 4.0  # it went round (12 s x 6 m/s / 15 m = 4.8 rad)


@pytest.mark.parametrize("latency_s", [0.0, 1.0])
def test_stop_plan_stops_at_its_line_and_stays_stopped(latency_s):
    stop_x = 30.0
    table, _ = drive(stop_plan(stop_x, 2.5), VehicleState(0.0, 0.0, 0.0, 10.0), 15.0, latency_s=latency_s)
    stopped = np.flatnonzero(table[:, 3] == 0.0)
    assert len(stopped) and stopped[0] * DT < 7.0  # measured 5.6-5.7 s
    assert stop_x - 1.0 <= table[-1, 0] <= stop_x + 1.0  # measured 30.4 m
    rest = table[stopped[0]:]
    assert np.all(rest[:, 3] == 0.0) and np.all(rest[:, 0] == rest[0, 0])  # no creeping
    assert np.all(np.diff(table[:, 0]) >= 0.0)  # no reversing
    assert np.abs(_jerk(table)).max() <= VehicleLimits().max_jerk + 1e-9


def test_a_single_stale_stop_plan_is_followed_to_its_end_and_held():
    speed, decel = 8.0, 3.0
    stop_x = speed ** 2 / (2 * decel)  # 10.7 m: rest inside the plan's 3 s
    table, _ = drive(stop_plan(stop_x, decel), VehicleState(0.0, 0.0, 0.0, speed), 12.0, replan_s=1000.0)
    assert table[-1, 3] == 0.0
    assert abs(table[-1, 0] - stop_x) <= 1.0  # measured +0.65 m
    assert np.all(table[int(6.0 / DT):, 0] == table[-1, 0])


def test_plan_on_the_car_brakes_to_a_standstill_without_a_jolt():
    table, _ = drive(stand_still, VehicleState(0.0, 0.0, 0.0, 10.0), 6.0)
    stop = int(np.flatnonzero(table[:, 3] == 0.0)[0])
    assert table[stop, 0] < 12.0  # measured 11.3 m; 8 m/s^2 after a 0.8 s jerk-limited ramp needs ~10 m
    assert table[:, 4].min() == pytest.approx(-VehicleLimits().max_brake)  # an emergency stop uses full braking
    assert abs(table[stop - 1, 4]) < 1.0  # it has eased off by the time it stops
    assert np.all(table[stop:, 0] == table[stop, 0])


def test_a_standing_car_does_not_creep_after_noisy_stop_plans():
    rng = np.random.default_rng(0)

    def jittery_stop(state, made_at):  # a network asked to stay: waypoints scattered within 0.35 m of the car
        return np.array([state.x, state.y]) + rng.uniform(-0.35, 0.35, (WAYPOINTS, 2)), _plan_times(made_at)

    table, _ = drive(jittery_stop, VehicleState(0.0, 0.0, 0.0, 0.0), 10.0)
    assert np.all(table[:, :2] == 0.0) and np.all(table[:, 3] == 0.0)


def test_a_plan_that_leads_behind_the_car_stops_it_rather_than_circling():
    def backwards(state, made_at):  # a planner gone wrong: 2 m/s straight back
        xy = np.array([state.x, state.y]) - 1.0 * np.arange(1, WAYPOINTS + 1)[:, None] * [math.cos(state.yaw), math.sin(state.yaw)]
        return xy, _plan_times(made_at)

    table, _ = drive(backwards, VehicleState(0.0, 0.0, 0.0, 5.0), 8.0)
    assert table[-1, 3] == 0.0 and np.all(np.diff(table[:, 0]) >= 0.0)
    assert np.abs(table[:, 2]).max() < 1e-9  # stopped straight: pure pursuit toward a point behind would turn full lock
    assert table[-1, 0] < 5.0  # measured 4.4 m (5 m/s, eased to a stop)


def test_limits_hold_every_step_of_a_step_change_plan():
    limits = VehicleLimits()
    table, commands = drive(step_changes, VehicleState(0.0, 0.0, 0.0, 5.0), 15.0, limits=limits)
    # the plan asks for more than the car can give: the raw commands break the rate limits...
    assert np.abs(np.diff(commands[:, 0])).max() / DT > 3 * limits.max_jerk
    assert np.abs(np.diff(commands[:, 1])).max() / DT > 3 * limits.max_steer_rate
    # ...the car never does
    tol = 1e-9
    assert table[:, 4].max() <= limits.max_accel + tol and table[:, 4].min() >= -limits.max_brake - tol
    assert np.abs(_jerk(table)).max() <= limits.max_jerk + tol
    assert np.abs(table[:, 5]).max() <= limits.max_steer + tol
    assert np.abs(np.diff(table[:, 5])).max() / DT <= limits.max_steer_rate + tol
    assert table[:, 3].min() >= 0.0
    # and it did what was asked: changed lane, reached speed, stopped
    lane_changed = table[int(8.9 / DT)]
    assert abs(lane_changed[1] - 3.5) < 0.3 and abs(lane_changed[3] - 15.0) < 0.5
    assert table[-1, 3] == 0.0


@pytest.mark.parametrize("plan_fn, start", [
    (straight_plan(10.0), VehicleState(0.0, 1.0, 0.1, 6.0)), (arc_plan(6.0, 15.0), VehicleState(0.0, 0.0, 0.0, 6.0)),
    (stop_plan(30.0, 2.5), VehicleState(0.0, 0.0, 0.0, 10.0)), (accelerating_plan(2.0, 10.0), VehicleState(0.0, 0.0, 0.0, 0.0))],
    ids=["straight", "arc", "stop", "accelerate"])
def test_comfortable_plans_are_driven_within_nuplans_comfort_bounds(plan_fn, start):
    # the comfort metric should score the plan: a plan within the bounds must not be pushed out of them by the tracker
    table, _ = drive(plan_fn, start, 15.0)
    assert -4.05 <= table[:, 4].min() and table[:, 4].max() <= 2.40  # nuPlan lon_accel bounds (measured -2.5..2.0)
    assert np.abs(_jerk(table)).max() <= 4.13  # nuPlan lon_jerk bound, here on the raw 10 Hz steps (measured 3.6)


def test_noisy_plans_are_smoothed_not_amplified():
    # a network's waypoints scatter: +-0.3 m (1 sigma) on every waypoint of every plan, 2 Hz, 0.2 s latency
    rng = np.random.default_rng(1)

    def noisy(state, made_at):
        xy, t = straight_plan(10.0)(state, made_at)
        return xy + rng.normal(0.0, 0.3, xy.shape), t

    table, _ = drive(noisy, VehicleState(0.0, 0.0, 0.0, 10.0), 30.0, latency_s=0.2)
    assert np.abs(table[:, 1]).max() < 0.5  # measured 0.35 m
    assert np.abs(table[:, 3] - 10.0).max() < 0.6  # measured 0.39 m/s
    assert np.abs(table[:, 4]).max() < 1.5  # measured 0.93 m/s^2 (a second difference of the waypoints: 3.2)
    assert np.abs(_jerk(table)).max() <= 4.13  # within nuPlan's comfort bound (the second difference: 10)


def _steady(plan_fn, state, seconds=6.0):
    """The car's states while tracking fresh plans for `seconds` (a steady state at the end), and the last time."""
    table, _ = drive(plan_fn, state, seconds)
    return [VehicleState(*row) for row in table], seconds - DT


@pytest.mark.parametrize("shape, stale_s", [("straight", 1.0), ("straight", 1.5), ("straight", 3.5), ("arc", 1.0), ("arc", 1.5)])
def test_a_stale_plan_gives_the_fresh_plans_command(shape, stale_s):
    plan_fn, speed = (straight_plan(10.0), 10.0) if shape == "straight" else (arc_plan(6.0, 15.0), 6.0)
    states, now = _steady(plan_fn, VehicleState(0.0, 0.0, 0.0, speed))
    state = states[-2]  # at `now`
    tracker = PlanTracker()
    fresh = tracker.command(state, *plan_fn(state, now), now)
    # made stale_s ago from where the car was then: its first waypoints are behind the car
    # (at 1.5 s: now = its first waypoint's time + 1 s; at 3.5 s: every waypoint is past)
    stale_xy, stale_t = plan_fn(states[-2 - int(round(stale_s / DT))], now - stale_s)
    assert np.dot(stale_xy[0] - [state.x, state.y], [math.cos(state.yaw), math.sin(state.yaw)]) < 0
    stale = tracker.command(state, stale_xy, stale_t, now)
    assert abs(stale[0] - fresh[0]) < 0.3  # m/s^2; measured 0.0 straight, 0.15-0.17 on the arc (0.1 m along-path)
    assert abs(stale[1] - fresh[1]) < 0.01  # rad; measured 0.0 / 0.0007


def test_passing_the_last_waypoint_of_a_moving_stale_plan_is_no_stop():
    state = VehicleState(30.0, 0.0, 0.0, 10.0)
    xy, t = straight_plan(10.0)(VehicleState(0.3, 0.0, 0.0, 10.0), 0.0)  # made 3 s ago, 30.3 m back
    assert abs(xy[-1, 0] - 30.3) < 1e-9  # only its last waypoint is still ahead in time, 0.3 m ahead of the car
    accel, steer = PlanTracker().command(state, xy, t, now=2.97)
    assert abs(accel) < 0.5 and abs(steer) < 1e-6  # it keeps going along the plan's extension (measured 0.0)


def test_a_standing_car_starts_and_follows_an_accelerating_plan():
    table, _ = drive(accelerating_plan(2.0, 10.0), VehicleState(0.0, 0.0, 0.0, 0.0), 10.0)
    assert np.all(np.diff(table[:, 0]) >= 0.0)
    assert table[int(1.0 / DT), 3] > 1.0  # it got going (measured 1.4 m/s after 1 s)
    assert abs(table[int(6.0 / DT), 3] - 10.0) < 0.5 and abs(table[-1, 3] - 10.0) < 0.1  # the plan: 10 m/s at 5 s
    assert table[:, 4].max() <= 2.0 + 0.3  # the plan's 2 m/s^2, not the car's 3


def test_a_faster_simulation_step_tracks_as_well():
    # drive.sim_hz is configurable: at 20 Hz (the tracker told its period) the figures hold
    dt = 0.05
    table, _ = drive(straight_plan(10.0), VehicleState(0.0, 1.0, 0.1, 8.0), 15.0, latency_s=0.5, dt=dt)
    assert np.abs(table[int(8.0 / dt):, 1]).max() < 0.05 and np.abs(table[int(8.0 / dt):, 3] - 10.0).max() < 0.05
    assert np.abs(np.diff(table[:, 4])).max() / dt <= 3.0 + 1e-9  # the comfort ramp, per second not per step
    table, _ = drive(arc_plan(6.0, 15.0), VehicleState(0.0, 0.0, 0.0, 6.0), 12.0, dt=dt)
    assert np.abs(np.hypot(table[:, 0], table[:, 1] - 15.0) - 15.0).max() < 0.5


def test_plans_are_checked():
    tracker, state = PlanTracker(), VehicleState(0.0, 0.0, 0.0, 5.0)
    xy = np.zeros((6, 2))
    with pytest.raises(ValueError, match="increase strictly"):
        tracker.command(state, xy, np.ones(6), 0.0)
    with pytest.raises(ValueError, match=r"\(T,2\)"):
        tracker.command(state, xy, np.arange(5.0), 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        tracker.command(state, np.full((6, 2), np.nan), np.arange(6.0), 0.0)


def test_the_loop_is_deterministic():
    first, _ = drive(step_changes, VehicleState(0.0, 0.0, 0.0, 5.0), 15.0, latency_s=0.3)
    second, _ = drive(step_changes, VehicleState(0.0, 0.0, 0.0, 5.0), 15.0, latency_s=0.3)
    assert np.array_equal(first, second)
