"""The closed loop's ego vehicle: a kinematic bicycle with a passenger car's limits, and the tracker that drives it along a plan.

The policy under test outputs waypoints (where the rear axle should be, and when); a car
cannot jump to them. `PlanTracker` turns the newest plan that has *arrived* (it may be
1-2 s old: the policy's latency is applied outside, in the episode loop) into an
acceleration and a steering angle, and `step_bicycle` moves the car under those commands
within what a passenger car can do (acceleration, braking, jerk, steering angle and rate).
So a plan that asks for the impossible (a 5 m sideways jump, 0 to 15 m/s at once) is driven
as a real car would drive it, and the metrics score what the car did, not what the plan said.

Model: the kinematic bicycle about the rear axle (R. Rajamani, Vehicle Dynamics and
Control, 2nd ed., Springer 2012, sec. 2.2; J. Kong, M. Pfeiffer, G. Schildbach, F. Borrelli,
"Kinematic and dynamic vehicle models for autonomous driving control design", IEEE IV 2015,
who show it predicts as well as a dynamic tyre model at the lateral accelerations of
normal driving, under ~0.5 g). About the rear axle the slip angle vanishes, so the state
the world and the planner use (rear-axle x, y, heading) integrates directly:
    x' = v cos(yaw),  y' = v sin(yaw),  yaw' = v tan(steer) / wheelbase.

Tracker: pure pursuit for steering (R. C. Coulter, "Implementation of the Pure Pursuit
Path Tracking Algorithm", CMU-RI-TR-92-01, 1992) and a speed loop with feed-forward of the
plan's acceleration for the pedals. Pure pursuit needs no model of the plan's timing, is
exact on arcs of constant curvature, and degrades gently on the coarse, noisy, stale
polylines a network produces; that is why it, and not an LQR on a fitted reference, is used.
A plan that stays where the car is, or ends at rest where the car has arrived, or leads
behind it (the car cannot reverse), brings the car to a standstill and holds it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VehicleLimits:
    """What a mid-size passenger car (4.6 m long, like the world's 4.5 m cars) can do.

    Sources for the defaults: wheelbase of 4.6-4.9 m sedans (VW Passat 2.79 m, Toyota Camry
    2.82 m); 3.0 m/s^2 is a 0-100 km/h time of ~9 s; 8.0 m/s^2 is full (emergency) braking
    on dry asphalt (friction ~0.8-0.9); brake systems build full pressure in ~0.5-0.8 s,
    i.e. a jerk of 10-15 m/s^3; a road-wheel angle of 0.6 rad (34 deg) gives a ~5.5 m
    turning radius at the outer front wheel (Camry: 5.7 m); 0.7 rad/s at the road wheels is
    ~640 deg/s at the steering wheel with a 16:1 ratio, the top speed of electric power steering.
    """

    wheelbase: float = 2.8
    """Rear axle to front axle, metres."""
    max_accel: float = 3.0
    """Strongest forward acceleration, m/s^2."""
    max_brake: float = 8.0
    """Strongest deceleration (emergency braking), m/s^2, positive."""
    max_jerk: float = 10.0
    """Fastest change of the acceleration command, m/s^3."""
    max_steer: float = 0.6
    """Largest road-wheel angle, radians, either side."""
    max_steer_rate: float = 0.7
    """Fastest road-wheel angle change, rad/s."""

    def __post_init__(self):
        for name in ("wheelbase", "max_accel", "max_brake", "max_jerk", "max_steer", "max_steer_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"VehicleLimits.{name} must be a positive number, got {value!r}")


@dataclass
class VehicleState:
    """The ego at one instant. x, y: the REAR AXLE in the world frame (metres); yaw: heading (rad, CCW from +x).

    speed >= 0 (m/s; the car never reverses); accel: the realised longitudinal acceleration
    (m/s^2; 0 while standing, whatever the brake holds); steer: road-wheel angle (rad, + left).
    """

    x: float
    y: float
    yaw: float
    speed: float
    accel: float = 0.0
    steer: float = 0.0


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def step_bicycle(state: VehicleState, accel_cmd: float, steer_cmd: float, dt: float,
                 limits: VehicleLimits = VehicleLimits()) -> VehicleState:
    """The state after dt seconds of the kinematic bicycle (about the rear axle) under the commands, limits applied.

    The acceleration command is clipped to [-max_brake, max_accel], then to within
    max_jerk * dt of the current acceleration; the steering command to +-max_steer, then
    to within max_steer_rate * dt of the current angle. Speed never goes negative: a brake
    command at standstill holds the car (realised acceleration 0), and a car that comes
    to rest inside the step stops there (its realised deceleration is what stopping took).
    The step is the circular arc of the mean speed and mean steering angle: exact for constant commands.
    """
    if not dt > 0:
        raise ValueError(f"step_bicycle needs a positive time step, got dt={dt!r}")
    jerk_step = limits.max_jerk * dt
    accel = _clip(_clip(float(accel_cmd), -limits.max_brake, limits.max_accel),
                  state.accel - jerk_step, state.accel + jerk_step)
    rate_step = limits.max_steer_rate * dt
    steer = _clip(_clip(float(steer_cmd), -limits.max_steer, limits.max_steer),
                  state.steer - rate_step, state.steer + rate_step)
    speed = state.speed + accel * dt
    moving_s = dt
    if speed < 0.0:  # comes to rest within the step: it moves only until then
        moving_s = state.speed / -accel if accel < 0 else 0.0
        speed = 0.0
    mean_speed = 0.5 * (state.speed + speed) if moving_s == dt else 0.5 * state.speed * moving_s / dt
    distance = mean_speed * dt
    turn = distance * math.tan(0.5 * (state.steer + steer)) / limits.wheelbase
    half = 0.5 * turn
    chord = distance * (math.sin(half) / half if abs(half) > 1e-9 else 1.0)  # the arc's chord: exact on circles
    return VehicleState(x=state.x + chord * math.cos(state.yaw + half),
                        y=state.y + chord * math.sin(state.yaw + half),
                        yaw=state.yaw + turn,
                        speed=speed,
                        accel=(speed - state.speed) / dt,
                        steer=steer)


class PlanPath:
    """A plan's polyline, extended behind its first waypoint and beyond its last along their headings.

    Arc length s is measured from the first waypoint (negative on the backward extension).
    The backward extension lets a car that is still behind a fresh plan's first waypoint
    project onto it; the forward one gives pure pursuit a lookahead point, and the speed
    loop a position, when the car (or the clock, for a stale plan) has passed the last waypoint.
    """

    EXTENSION_M = 200.0

    def __init__(self, plan_xy: np.ndarray, fallback_yaw: float):
        points = np.asarray(plan_xy, dtype=np.float64)
        steps = np.diff(points, axis=0)
        lengths = np.hypot(steps[:, 0], steps[:, 1])
        self.waypoint_s = np.concatenate([[0.0], np.cumsum(lengths)])
        moving = np.flatnonzero(lengths > 1e-6)
        first = steps[moving[0]] / lengths[moving[0]] if len(moving) else np.array([math.cos(fallback_yaw), math.sin(fallback_yaw)])
        last = steps[moving[-1]] / lengths[moving[-1]] if len(moving) else first
        keep = np.concatenate([[True], lengths > 1e-6])
        self.points = np.concatenate([[points[0] - self.EXTENSION_M * first], points[keep],
                                      [points[-1] + self.EXTENSION_M * last]])
        self.s = np.concatenate([[-self.EXTENSION_M], self.waypoint_s[keep], [self.waypoint_s[-1] + self.EXTENSION_M]])

    def project(self, xy: np.ndarray) -> float:
        """Arc length of the point of the path nearest to xy (the first one on a tie)."""
        start, end = self.points[:-1], self.points[1:]
        seg = end - start
        seg_len2 = np.maximum(np.einsum("ij,ij->i", seg, seg), 1e-12)
        u = np.clip(np.einsum("ij,ij->i", xy - start, seg) / seg_len2, 0.0, 1.0)
        nearest = start + u[:, None] * seg
        i = int(np.argmin(np.einsum("ij,ij->i", nearest - xy, nearest - xy)))
        return float(self.s[i] + u[i] * (self.s[i + 1] - self.s[i]))

    def at(self, s: float) -> np.ndarray:
        """The path's point at arc length s."""
        return np.array([np.interp(s, self.s, self.points[:, 0]), np.interp(s, self.s, self.points[:, 1])])


@dataclass(frozen=True)
class TrackerGains:
    """Tuning of PlanTracker; tests/sim/test_vehicle.py holds the figures these give."""

    lookahead_min: float = 4.0
    """Pure-pursuit lookahead at low speed, metres (above the wheelbase, so slow turns do not oscillate)."""
    lookahead_time: float = 0.8
    """Lookahead grows as speed x this many seconds: longer lookahead is smoother, shorter cuts fewer corners."""
    lookahead_max: float = 20.0
    """Lookahead cap, metres."""
    speed_gain: float = 1.5
    """Acceleration per m/s of speed error, 1/s (time constant ~0.7 s, above the jerk limit's ramp)."""
    accel_fit_s: tuple = (0.5, 1.0, 1.5, 2.0, 2.5)
    """Times ahead (s) at which the plan's positions are fitted for its acceleration (the feed-forward)."""
    position_horizon_s: float = 1.0
    """The speed asked for brings the car to where the plan wants it this far ahead: a fixed horizon, so
    the along-path position error maps to speed with one gain (1/horizon) however stale the plan."""
    catch_up: float = 2.0
    """A car behind its plan drives at most this much faster than the plan's fastest speed, m/s."""
    stop_radius: float = 0.5
    """A plan that stays within this distance of the car (its waypoints still ahead in time, and where it wants
    the car position_horizon_s from now) asks it to stand still, metres: no creeping after a noisy planner."""
    rest_speed: float = 0.5
    """A plan whose last interval is slower than this, m/s, ends at rest: the car stops at its end."""
    stop_decel: float = 3.0
    """Deceleration a plan that ends at rest is allowed to ask for in reaching its end (a firm stop), m/s^2."""
    hold_speed: float = 0.01
    """At or below this speed (m/s) the car counts as stopped: the brake holds it."""
    hold_brake: float = 1.5
    """Brake command that holds a stopped car, m/s^2 (speed cannot go below zero: it only keeps it there)."""
    comfort_jerk: float = 3.0
    """The command changes by at most this, m/s^3, while it stays within normal driving: the comfort metric
    then scores the plan, not the tracker's step responses (nuPlan's bound is 4.13 m/s^3, estimated by a
    Savitzky-Golay fit that reads ramps of 4 m/s^3 that change direction as ~5)."""
    release_jerk: float = 2.0
    """A stop's final release from comfort_brake to standing, m/s^3: below comfort_jerk, so the ramp keeps up."""
    comfort_accel: float = 2.0
    """The speed loop's own correction accelerates at most this, m/s^2, unless the plan itself asks for more
    (nuPlan's comfortable bound is 2.40 m/s^2)."""
    comfort_brake: float = 4.0
    """Braking harder than this, m/s^2, is an emergency: the command goes at once, only the car's jerk limit
    applies (nuPlan's comfortable bound is 4.05 m/s^2; an expert's firm stop at a line brakes at ~3.5)."""


class PlanTracker:
    """Follows the newest plan: pure pursuit (lateral) and speed control with feed-forward (longitudinal).

    Stateless between calls: the command depends on the state, the plan and the time only,
    so episodes replay exactly and a new plan takes effect at once. dt is the control
    period (the simulation step, data.world.traffic.SIM_DT), used by the comfort jerk limit.
    """

    def __init__(self, limits: VehicleLimits = VehicleLimits(), gains: TrackerGains = TrackerGains(), dt: float = 0.1):
        if not dt > 0:
            raise ValueError(f"PlanTracker needs a positive control period, got dt={dt!r}")
        self.limits = limits
        self.gains = gains
        self.dt = dt

    def command(self, state: VehicleState, plan_xy: np.ndarray, plan_t: np.ndarray, now: float,
                dt: float | None = None) -> tuple[float, float]:
        """(acceleration m/s^2, road-wheel angle rad) that follow plan_xy (T,2), world frame, rear axle, at times plan_t (T,).

        `dt` is how long the command will be held (default: the control period): the episode loop holds a
        command for less when a new plan arrives inside a period (`stack.sim.episode`), and the comfort ramp
        and the stop are sized for the time the command is actually held.

        now may be past some (or all) of the plan's times: the plan is followed from where
        the car is, at the speeds the plan asks for from now on, along its path extended
        beyond its last waypoint. A plan whose path leads behind the car asks it to reverse,
        which it cannot: it stops, as it does for a plan that stays where the car is.
        """
        held = self.dt if dt is None else dt
        if not held > 0:
            raise ValueError(f"a command is held for a positive time, got dt={dt!r}")
        plan_xy, plan_t = self._checked(plan_xy, plan_t)
        path = PlanPath(plan_xy, state.yaw)
        position = np.array([state.x, state.y])
        s_car = path.project(position)
        forward, left = self._goal(state, path, s_car)
        if forward < 0.0 or self._asks_to_stop(path, plan_xy, plan_t, now, position, s_car):
            return self._comfortable(self._stop(state, held), state, held), state.steer
        accel = self._longitudinal(state, path, plan_t, now, s_car)
        return self._comfortable(accel, state, held), self._pure_pursuit(forward, left)

    def _comfortable(self, accel: float, state: VehicleState, held: float) -> float:
        """Ramp the command at comfort_jerk within normal driving; into or out of harder braking than
        comfort_brake (an emergency, or its release) it goes at once, and only the car's jerk limit applies."""
        if min(accel, state.accel) < -self.gains.comfort_brake:
            return accel
        ramp = self.gains.comfort_jerk * held
        return _clip(accel, state.accel - ramp, state.accel + ramp)

    @staticmethod
    def _checked(plan_xy, plan_t) -> tuple[np.ndarray, np.ndarray]:
        plan_xy = np.asarray(plan_xy, dtype=np.float64)
        plan_t = np.asarray(plan_t, dtype=np.float64)
        if plan_xy.ndim != 2 or plan_xy.shape[1] != 2 or len(plan_xy) < 1 or plan_t.shape != (len(plan_xy),):
            raise ValueError(f"a plan is (T,2) waypoints with (T,) times, got {plan_xy.shape} and {plan_t.shape}")
        if not (np.isfinite(plan_xy).all() and np.isfinite(plan_t).all()):
            raise ValueError("the plan has non-finite waypoints or times")
        if np.any(np.diff(plan_t) <= 0):
            raise ValueError(f"plan times must increase strictly, got {plan_t.tolist()}")
        return plan_xy, plan_t

    def _asks_to_stop(self, path, plan_xy, plan_t, now, position, s_car) -> bool:
        """True when the plan stays within stop_radius of the car from now on (its waypoints still ahead in
        time, and where it wants the car position_horizon_s from now), or the car has reached (or passed)
        the end of a plan that ends at rest: stand still rather than chase centimetres. The horizon point
        keeps a moving stale plan, whose last waypoint the car is just passing, from reading as a stop."""
        later = path.at(self._plan_s_at(path, plan_t, now + self.gains.position_horizon_s))
        remaining = np.concatenate([plan_xy[plan_t > now], later[None]])
        if np.max(np.hypot(*(remaining - position).T)) <= self.gains.stop_radius:
            return True
        return self._ends_at_rest(path, plan_t) and path.waypoint_s[-1] - s_car <= self.gains.stop_radius

    def _ends_at_rest(self, path, plan_t) -> bool:
        """The plan's last interval is slower than rest_speed: it comes to rest (a stop line, a stopped leader)."""
        if len(plan_t) < 2:
            return True
        return path.waypoint_s[-1] - path.waypoint_s[-2] < self.gains.rest_speed * (plan_t[-1] - plan_t[-2])

    def _stop(self, state: VehicleState, held: float) -> float:
        """Brake as hard as the car can, easing off so the deceleration reaches zero as the speed does, then hold.

        A deceleration a released at jerk j reaches zero after the car loses a^2 / (2 j) of
        speed. The release runs at half the car's jerk above comfort_brake (an emergency) and
        at release_jerk below it (margins the 10 Hz control and the comfort ramp can follow),
        so the stop is full braking down to ~8 m/s, then easing to a standstill without a
        jolt. Never more than speed / dt, which stops the car exactly at the end of the step.
        """
        if state.speed < self.gains.hold_speed:
            return -self.gains.hold_brake
        gentle, hard = self.gains.release_jerk, self.limits.max_jerk
        firm = self.gains.comfort_brake
        gentle_speed = firm ** 2 / (2.0 * gentle)  # speed lost releasing from comfort_brake at the gentle jerk
        if state.speed <= gentle_speed:
            decel = math.sqrt(2.0 * gentle * state.speed)
        else:
            decel = math.sqrt(firm ** 2 + 2.0 * hard * (state.speed - gentle_speed))
        return -min(decel, self.limits.max_brake, state.speed / held)

    @staticmethod
    def _plan_s_at(path, plan_t, t: float) -> float:
        """Arc length where the plan wants the car at time t: between waypoints linear in time; past the last,
        on at the last interval's speed (the forward extension); before the first, back at the first's."""
        s = path.waypoint_s
        if len(s) == 1:
            return 0.0
        if t > plan_t[-1]:
            return float(s[-1] + (t - plan_t[-1]) * (s[-1] - s[-2]) / (plan_t[-1] - plan_t[-2]))
        if t < plan_t[0]:
            return float(s[0] - (plan_t[0] - t) * (s[1] - s[0]) / (plan_t[1] - plan_t[0]))
        return float(np.interp(t, plan_t, s))

    def _plan_accel(self, path, plan_t, now: float) -> float:
        """The plan's acceleration over the next seconds: twice the quadratic term of a least-squares fit
        of where it wants the car at now + 0.5, 1.0, ... 2.5 s.

        A second difference of consecutive waypoints amplifies their noise ~10x (a network's
        waypoints scatter by decimetres: +-0.3 m reads as +-3 m/s^2); the fit over 2 s
        amplifies it ~2x, and still follows a plan that brakes to a stop within its horizon.
        """
        if len(plan_t) < 2:
            return 0.0
        ahead = self.gains.accel_fit_s
        s = np.array([self._plan_s_at(path, plan_t, now + t) for t in ahead])
        return float(2.0 * np.polyfit(ahead, s, 2)[0])

    def _longitudinal(self, state, path, plan_t, now, s_car) -> float:
        """Feed-forward of the plan's acceleration (fitted) plus a proportional loop on the speed the plan asks for.

        The speed asked for is the one that takes the car from where it is to where the plan
        wants it position_horizon_s from now (the segment from the current position: behind
        the plan, faster; ahead of it, slower), less the plan's own acceleration over half
        that horizon, so a braking plan asks for today's speed, not the horizon's mean. It
        never exceeds the plan's fastest speed by more than catch_up, so a car left far
        behind does not race. No derivative term: the speed error jumps whenever a new plan
        arrives and a D term would turn each replan into a kick; the jerk limit already smooths.
        A plan that ends at rest caps the speed at what stops the car at its end with stop_decel.
        """
        g = self.gains
        plan_accel = self._plan_accel(path, plan_t, now)
        feed_forward = _clip(plan_accel, -self.limits.max_brake, self.limits.max_accel)
        horizon = g.position_horizon_s
        mean_speed = (self._plan_s_at(path, plan_t, now + horizon) - s_car) / horizon
        wanted = max(mean_speed - 0.5 * horizon * plan_accel, 0.0)
        if len(plan_t) > 1:
            wanted = min(wanted, float(np.max(np.diff(path.waypoint_s) / np.diff(plan_t))) + g.catch_up)
        if self._ends_at_rest(path, plan_t):
            to_go = max(path.waypoint_s[-1] - s_car, 0.0)
            reachable = math.sqrt(2.0 * g.stop_decel * to_go)
            if wanted > reachable:
                wanted = reachable
                feed_forward = min(feed_forward, -state.speed ** 2 / (2.0 * max(to_go, 0.1)))
        accel = min(feed_forward + g.speed_gain * (wanted - state.speed), max(g.comfort_accel, feed_forward))
        return _clip(accel, -self.limits.max_brake, self.limits.max_accel)

    def lookahead(self, speed: float) -> float:
        """Pure-pursuit lookahead distance at this speed, metres."""
        g = self.gains
        return _clip(g.lookahead_time * speed, g.lookahead_min, g.lookahead_max)

    def _goal(self, state, path, s_car) -> tuple[float, float]:
        """(forward, left) of pure pursuit's goal point in the car's frame, metres: the path point one
        lookahead beyond the car's projection on it.

        Found by arc length from the car's projection, so a stale plan that starts behind the
        car is followed from where the car is, and a car beyond the plan's end steers along
        the extension of its last heading.
        """
        goal = path.at(s_car + self.lookahead(state.speed)) - np.array([state.x, state.y])
        cos_yaw, sin_yaw = math.cos(state.yaw), math.sin(state.yaw)
        return goal[0] * cos_yaw + goal[1] * sin_yaw, -goal[0] * sin_yaw + goal[1] * cos_yaw

    def _pure_pursuit(self, forward: float, left: float) -> float:
        """Steer onto the arc through the rear axle and the goal point (Coulter 1992, eq. 1: curvature 2 y / l^2)."""
        curvature = 2.0 * left / max(forward ** 2 + left ** 2, 1e-6)
        steer = math.atan(self.limits.wheelbase * curvature)
        return _clip(steer, -self.limits.max_steer, self.limits.max_steer)
