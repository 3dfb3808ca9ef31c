"""Closed-loop driving metrics: one episode's trace in, nuPlan / NAVSIM / CARLA scores out.

Open-loop L2 rewards copying the ego's own status (AD-MLP, arXiv:2305.10430; "Is ego status
all you need?", arXiv:2312.03031); closed-loop scores judge what the driving did. Three published
definitions are computed from the same `EpisodeTrace` (numpy only, so the simulator's
worker processes need no torch to score):

- nuPlan's closed-loop metrics (Caesar et al. 2021, arXiv:2106.11810; nuplan-devkit
  docs/metrics_description.md): no ego at-fault collisions, drivable-area compliance,
  time-to-collision within bound, ego progress, comfort.
- NAVSIM's PDM score (Dauner et al. 2024, arXiv:2406.15349), which multiplies them:
  PDMS = NC * DAC * (5 * TTC + 2 * C + 5 * EP) / 12.
- The CARLA leaderboard's driving score (leaderboard.carla.org/#driving-score):
  DS = RC * prod(infraction penalties).

Where our world differs from theirs (no lanes, no HD map, parked cars that are scenery)
the docstring of the function that decides says what we chose and why. Every collision
and time-to-collision test is an oriented-box overlap (separating axis theorem).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stack.errors import StackError

AGENT_CLASSES = ("car", "truck", "pedestrian", "cyclist")
VEHICLE_CLASSES = ("car", "truck")

STOPPED_SPEED_MPS = 0.05
"""Below this the ego (or an agent) is stopped: nuPlan's collision_utils STOPPED_SPEED_THRESHOLD (5e-2 m/s)."""

TTC_BOUND_S = 0.95
"""nuPlan's time_to_collision_within_bound `least_min_ttc`: a projected collision sooner than this violates it."""
TTC_STEP_S = 0.1
"""Projection step for the time-to-collision test (NAVSIM's PDM scorer projects at the 10 Hz simulation rate)."""
BEHIND_ANGLE_DEG = 150.0
"""An agent whose bearing from the ego's heading exceeds this is behind it (nuPlan's `is_agent_behind` tolerance)."""

COMFORT_BOUNDS = {
    "lon_accel": (-4.05, 2.40),   # m/s^2, nuPlan ego_is_comfortable min_lon_accel / max_lon_accel
    "lat_accel": (-4.89, 4.89),   # m/s^2, max_abs_lat_accel
    "yaw_rate": (-0.95, 0.95),    # rad/s, max_abs_yaw_rate
    "yaw_accel": (-1.93, 1.93),   # rad/s^2, max_abs_yaw_accel
    "lon_jerk": (-4.13, 4.13),    # m/s^3, max_abs_lon_jerk
    "jerk": (-8.37, 8.37),        # m/s^3, max_abs_mag_jerk
}
"""nuPlan's comfort thresholds (nuplan-devkit metrics_description, `ego_is_comfortable`; the same values
NAVSIM's PDM comfort term uses). Within all of them over the whole episode: C = 1, else C = 0."""
SAVGOL_WINDOW = 5
"""Derivatives are a quadratic Savitzky-Golay fit over 5 samples, nuPlan's `approximate_derivatives` defaults."""

PDMS_WEIGHTS = {"ttc": 5.0, "comfort": 2.0, "ego_progress": 5.0}
"""NAVSIM's weights of the averaged PDMS terms (arXiv:2406.15349, Eq. 1)."""
EP_MIN_EXPERT_PROGRESS_M = 5.0
"""NAVSIM scores EP = 1 when the expert itself progresses less than this (a ratio of two small numbers is noise)."""
NC_STATIC = 0.5
"""NAVSIM's NC for an at-fault collision with a static object (0 for a vehicle, pedestrian or cyclist)."""

ENDINGS = ("collision", "blocked", "route_deviation")
"""Infractions that end a drive early (`stack.sim.infractions`), as the CARLA leaderboard ends a route."""
MIN_SPEED_BASE = 0.7
"""CARLA leaderboard 2.0's minimum-speed infraction: penalty 0.7 + 0.3 x (the ego's average speed over the
surrounding traffic's), per infraction below 100 % (its results report 'Average speed is 89.22% of the
surrounding traffic's one' with a penalty factor of 0.9677). Our reference speed is the privileged expert's on
the same episode (`min_speed_penalty`)."""

CARLA_PENALTIES = {"pedestrian": 0.50, "vehicle": 0.60, "static": 0.65}
"""The CARLA leaderboard's penalty coefficients per collision (leaderboard.carla.org/#driving-score; the
leaderboard's statistics_manager PENALTY_VALUE_DICT). Cyclists count as vehicles there: scenario_runner's
CollisionTest classes the other actor by its blueprint id ('static' / 'vehicle' / 'walker'), and CARLA's
bicycles are `vehicle.*` blueprints (vehicle.bh.crossbike, ...), so hitting one costs 0.60."""


@dataclass(eq=False)
class EpisodeTrace:
    """What happened in one closed-loop episode, sampled every `dt` seconds (S steps, A agents).

    Positions are BOX CENTRES in the world frame; yaw in radians; speeds >= 0 along the yaw.
    Construction validates shapes and values and raises a StackError naming the field.
    """

    dt: float
    ego: np.ndarray            # (S, 5) x, y (box centre), yaw, speed, longitudinal accel
    ego_size: tuple            # (length, width) m
    agents: np.ndarray         # (S, A, 4) x, y (box centre), yaw, speed
    agent_sizes: np.ndarray    # (A, 2) length, width m
    agent_classes: list        # (A,) one of AGENT_CLASSES
    agent_static: np.ndarray   # (A,) bool: parked car / static object
    progress: np.ndarray       # (S,) arc length along the route (m) minus its value at step 0
    route_length: float        # progress that counts as 100 % route completion (m)
    on_drivable: np.ndarray    # (S,) bool: every corner of the ego footprint on drivable ground
    agent_valid: np.ndarray | None = None
    """Optional (S, A) bool: the agent exists at that step (not yet spawned / gone: False, its values
    may be NaN and are ignored). None: every agent exists at every step."""
    ended: str = ""
    """Why the drive ended before its time, if it did: one of ENDINGS (`stack.sim.infractions`); "" when it ran
    its time. The trace then stops at that step, and every score is of the part driven."""

    def __post_init__(self):
        if self.ended not in ("",) + ENDINGS:
            raise _trace_error("ended", f"'' or one of {ENDINGS}", repr(self.ended))
        self.dt = _positive_scalar("dt", self.dt)
        self.route_length = _positive_scalar("route_length", self.route_length)
        self._check_ego()
        steps = self.ego.shape[0]
        self._check_agents(steps)
        self.progress = _finite_array("progress", self.progress, (steps,), f"(S={steps},) metres along the route")
        self.on_drivable = _bool_array("on_drivable", self.on_drivable, (steps,))

    def _check_ego(self) -> None:
        self.ego = _finite_array("ego", self.ego, (None, 5), "(S, 5): x, y, yaw, speed, accel per step")
        if self.ego.shape[0] < 1:
            raise _trace_error("ego", "(S, 5) with S >= 1 steps", f"shape {self.ego.shape}")
        if (self.ego[:, 3] < 0).any():
            raise _trace_error("ego", "speed (column 3) >= 0", f"min speed {self.ego[:, 3].min():g}")
        self.ego_size = tuple(_finite_array("ego_size", self.ego_size, (2,), "(length, width) > 0"))
        if min(self.ego_size) <= 0:
            raise _trace_error("ego_size", "(length, width) > 0", f"{self.ego_size}")

    def _check_agents(self, steps: int) -> None:
        expected = f"(S={steps}, A, 4): x, y, yaw, speed"
        agents = _finite_array("agents", self.agents, (steps, None, 4), expected, check_finite=False)
        count = agents.shape[1]
        if self.agent_valid is None:
            self.agent_valid = np.ones((steps, count), dtype=bool)
        self.agent_valid = _bool_array("agent_valid", self.agent_valid, (steps, count))
        absent = ~self.agent_valid[..., None]          # absent agents may hold NaN: zeros, then masked out
        self.agents = _finite_array("agents", np.where(absent, 0.0, agents), (steps, None, 4), expected)
        if (self.agents[..., 3] < 0).any():
            raise _trace_error("agents", "speed (column 3) >= 0", f"min speed {self.agents[..., 3].min():g}")
        self.agent_sizes = _finite_array("agent_sizes", self.agent_sizes, (count, 2), f"(A={count}, 2): length, width")
        if (self.agent_sizes <= 0).any():
            raise _trace_error("agent_sizes", "lengths and widths > 0", f"min {self.agent_sizes.min():g}")
        self.agent_classes = list(self.agent_classes)
        unknown = sorted({str(name) for name in self.agent_classes if name not in AGENT_CLASSES})
        if len(self.agent_classes) != count or unknown:
            found = f"{len(self.agent_classes)} names" + (f", unknown {unknown}" if unknown else "")
            raise _trace_error("agent_classes", f"{count} names from {AGENT_CLASSES}", found)
        self.agent_static = _bool_array("agent_static", self.agent_static, (count,))

    @property
    def steps(self) -> int:
        return self.ego.shape[0]


def _trace_error(field: str, expected: str, found: str) -> StackError:
    return StackError(f"EpisodeTrace.{field}: expected {expected}, found {found}. "
                      "The episode loop built a bad trace: check how it records this field.")


def _positive_scalar(field: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _trace_error(field, "a number > 0", repr(value)) from None
    if not np.isfinite(number) or number <= 0:
        raise _trace_error(field, "a finite number > 0", repr(value))
    return number


def _finite_array(field: str, value, shape: tuple, expected: str, check_finite: bool = True) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise _trace_error(field, expected, f"values that are not numbers ({type(value).__name__})") from None
    fits = array.ndim == len(shape) and all(want is None or want == got for want, got in zip(shape, array.shape))
    if not fits:
        raise _trace_error(field, expected, f"shape {array.shape}")
    if check_finite and not np.isfinite(array).all():
        where = np.argwhere(~np.isfinite(array))[0]
        raise _trace_error(field, "finite values", f"{array[tuple(where)]} at index {tuple(int(i) for i in where)}")
    return array


def _bool_array(field: str, value, shape: tuple) -> np.ndarray:
    array = np.asarray(value)
    if array.shape != shape or array.dtype.kind not in "bui":
        raise _trace_error(field, f"{shape} booleans", f"shape {array.shape}, dtype {array.dtype}")
    return array.astype(bool)


# ---------------------------------------------------------------------------------------------- geometry


def boxes_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether oriented boxes overlap (separating axis theorem); a, b (..., 5) x, y, yaw, length, width.

    Two convex polygons are disjoint iff some edge normal separates their projections; for
    rectangles the four candidate axes are the boxes' own. On each axis the boxes are separated
    when the centre distance projected on it reaches the sum of their projected half extents,
    which for rectangles depend only on |cos| and |sin| of the yaw difference. A zero width or
    length is a segment (the bumper test uses that). Touching boxes do not overlap. Broadcasts.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    dx, dy = b[..., 0] - a[..., 0], b[..., 1] - a[..., 1]
    cos_a, sin_a, cos_b, sin_b = np.cos(a[..., 2]), np.sin(a[..., 2]), np.cos(b[..., 2]), np.sin(b[..., 2])
    cos_d = np.abs(cos_a * cos_b + sin_a * sin_b)                     # |cos(yaw_b - yaw_a)|
    sin_d = np.abs(sin_b * cos_a - cos_b * sin_a)
    half_la, half_wa, half_lb, half_wb = a[..., 3] / 2, a[..., 4] / 2, b[..., 3] / 2, b[..., 4] / 2
    separated = np.abs(dx * cos_a + dy * sin_a) >= half_la + half_lb * cos_d + half_wb * sin_d   # a's length axis
    separated |= np.abs(-dx * sin_a + dy * cos_a) >= half_wa + half_lb * sin_d + half_wb * cos_d  # a's width axis
    separated |= np.abs(dx * cos_b + dy * sin_b) >= half_lb + half_la * cos_d + half_wa * sin_d   # b's length axis
    separated |= np.abs(-dx * sin_b + dy * cos_b) >= half_wb + half_la * sin_d + half_wa * cos_d  # b's width axis
    return ~separated


def _heading(yaw: np.ndarray) -> np.ndarray:
    """(..., 2) unit vectors along the yaw."""
    return np.stack([np.cos(yaw), np.sin(yaw)], -1)


def _ego_boxes(trace: EpisodeTrace) -> np.ndarray:
    """(S, 5) ego boxes."""
    length, width = trace.ego_size
    return np.concatenate([trace.ego[:, :3], np.full((trace.steps, 1), length), np.full((trace.steps, 1), width)], 1)


def _agent_boxes(trace: EpisodeTrace) -> np.ndarray:
    """(S, A, 5) agent boxes."""
    sizes = np.broadcast_to(trace.agent_sizes, trace.agents.shape[:2] + (2,))
    return np.concatenate([trace.agents[..., :3], sizes], -1)


BUMPER_DEPTH_M = 1e-6
"""The bumper segment's thickness: touching a box counts as hitting it (shapely's `intersects`, as nuPlan tests)."""


def _bumper(ego: np.ndarray, side: float) -> np.ndarray:
    """(S, 5) the front (side=+1) or rear (side=-1) bumper of ego boxes, as (nearly) zero-length boxes."""
    heading = _heading(ego[:, 2])
    bumper = ego.copy()
    bumper[:, :2] += side * ego[:, 3:4] / 2 * heading
    bumper[:, 3] = BUMPER_DEPTH_M
    return bumper


# ---------------------------------------------------------------------------------------------- collisions


def collision_events(trace: EpisodeTrace) -> list[dict]:
    """One event per agent track the ego touches: its first contact, classified by fault.

    nuPlan (`no_ego_at_fault_collisions`, collision_utils.get_collision_type) counts each
    track once and decides fault at the first contact, in this order:
    - ego stopped (speed < STOPPED_SPEED_MPS): STOPPED_EGO, not at fault;
    - the agent stopped or static: STOPPED_TRACK, at fault (the ego drove into it);
    - the agent touches the ego's rear bumper but not its front: ACTIVE_REAR, not at fault
      (nuPlan asks whether the agent is behind; the bumper test says the same for boxes);
    - the front bumper touches it: ACTIVE_FRONT, at fault;
    - otherwise ACTIVE_LATERAL, at fault. nuPlan blames a lateral hit only when the ego
      straddles lanes or leaves the drivable area; our world has no lane map, so every
      lateral hit is the ego's (the brief's rule, stricter than nuPlan's).
    Returns dicts: agent, step, time_s, kind, at_fault, category (vehicle | pedestrian | cyclist | static).
    """
    if trace.agents.shape[1] == 0:
        return []
    ego, agents = _ego_boxes(trace), _agent_boxes(trace)
    touching = boxes_overlap(ego[:, None], agents) & trace.agent_valid  # (S, A)
    events = []
    for agent in np.flatnonzero(touching.any(axis=0)):
        step = int(np.argmax(touching[:, agent]))
        kind = collision_kind(ego[step], trace.ego[step, 3], agents[step, agent], trace.agents[step, agent, 3],
                              bool(trace.agent_static[agent]))
        events.append({"agent": int(agent), "step": step, "time_s": step * trace.dt, "kind": kind,
                       "at_fault": kind in AT_FAULT_KINDS,
                       "category": _category(trace, agent)})
    return sorted(events, key=lambda event: (event["step"], event["agent"]))


AT_FAULT_KINDS = ("stopped_track", "active_front", "active_lateral")


def collision_kind(ego: np.ndarray, ego_speed: float, agent: np.ndarray, agent_speed: float, static: bool) -> str:
    """nuPlan's collision type of one contact (see `collision_events`); boxes are (5,) x, y, yaw, length, width.
    The simulator calls it every step to end an episode at an at-fault collision (`stack.sim.infractions`),
    the scores on the trace afterwards: one rule for both."""
    if ego_speed < STOPPED_SPEED_MPS:
        return "stopped_ego"
    if static or agent_speed < STOPPED_SPEED_MPS:
        return "stopped_track"
    front = boxes_overlap(_bumper(ego[None], +1.0)[0], agent)
    rear = boxes_overlap(_bumper(ego[None], -1.0)[0], agent)
    if rear and not front:
        return "active_rear"
    return "active_front" if front else "active_lateral"


def _category(trace: EpisodeTrace, agent: int) -> str:
    """The object class the scores penalise: a parked car or static object is 'static'.

    NAVSIM halves NC for static objects by class (barriers, cones); here parked cars are the
    scenery (CARLA leaderboard 2.x likewise spawns parked cars as static props, so its
    collision test counts them as static), hence the `agent_static` flag decides.
    """
    if trace.agent_static[agent]:
        return "static"
    name = trace.agent_classes[agent]
    return "vehicle" if name in VEHICLE_CLASSES else name


# ---------------------------------------------------------------------------------------------- TTC


def ttc_violations(trace: EpisodeTrace, bound_s: float = TTC_BOUND_S, step_s: float = TTC_STEP_S) -> np.ndarray:
    """(S,) bool: at this step a constant-velocity projection collides sooner than `bound_s`.

    nuPlan's time_to_collision_within_bound: while the ego moves, project the ego and every
    agent forward at their current velocity (along their yaw) and find the first time their
    boxes overlap; TTC < 0.95 s is a violation. Agents already touching the ego and agents
    behind it (bearing > BEHIND_ANGLE_DEG, e.g. a car closing in from the rear) are ignored,
    as nuPlan ignores colliding tracks and tracks behind the ego.
    """
    if trace.agents.shape[1] == 0:
        return np.zeros(trace.steps, dtype=bool)
    ego, agents = _ego_boxes(trace), _agent_boxes(trace)
    times = step_s * np.arange(1, int(np.ceil(bound_s / step_s - 1e-9)))   # 0.1 .. 0.9 s, all < bound_s
    ego_future = _project(ego, trace.ego[:, 3], times)                      # (S, K, 5)
    agent_future = _project(agents, trace.agents[..., 3], times)           # (S, A, K, 5)
    hits = boxes_overlap(ego_future[:, None], agent_future).any(axis=-1)   # (S, A)
    relevant = ~boxes_overlap(ego[:, None], agents) & ~_behind(trace) & trace.agent_valid
    moving = trace.ego[:, 3] >= STOPPED_SPEED_MPS
    return (hits & relevant).any(axis=1) & moving


def _project(boxes: np.ndarray, speed: np.ndarray, times: np.ndarray) -> np.ndarray:
    """(..., K, 5) boxes moved at constant velocity to each of `times`."""
    heading = _heading(boxes[..., 2])
    moved = np.repeat(boxes[..., None, :], len(times), axis=-2)
    moved[..., :2] += (speed[..., None, None] * heading[..., None, :]) * times[:, None]
    return moved


def _behind(trace: EpisodeTrace) -> np.ndarray:
    """(S, A) agent centre lies behind the ego (bearing from its heading over BEHIND_ANGLE_DEG)."""
    offset = trace.agents[..., :2] - trace.ego[:, None, :2]
    bearing = np.arctan2(offset[..., 1], offset[..., 0]) - trace.ego[:, None, 2]
    bearing = np.abs((bearing + np.pi) % (2 * np.pi) - np.pi)
    return bearing > np.radians(BEHIND_ANGLE_DEG)


# ---------------------------------------------------------------------------------------------- comfort


def comfort_signals(trace: EpisodeTrace) -> dict[str, np.ndarray]:
    """(S,) signals nuPlan's ego_is_comfortable bounds, derivatives by Savitzky-Golay (5 samples, quadratic).

    lon_accel is the trace's own; yaw_rate the derivative of the unwrapped yaw; lat_accel =
    speed * yaw_rate; lon_jerk the derivative of lon_accel; jerk the derivative of the
    acceleration magnitude |(lon, lat)|, as nuPlan's ego_jerk (acceleration_coordinate
    'magnitude'). A step change in commanded acceleration is a jerk: controllers must ramp.
    """
    yaw_rate = _derivative(np.unwrap(trace.ego[:, 2]), trace.dt)
    lon_accel = trace.ego[:, 4]
    lat_accel = trace.ego[:, 3] * yaw_rate
    return {"lon_accel": lon_accel, "lat_accel": lat_accel, "yaw_rate": yaw_rate,
            "yaw_accel": _derivative(yaw_rate, trace.dt), "lon_jerk": _derivative(lon_accel, trace.dt),
            "jerk": _derivative(np.hypot(lon_accel, lat_accel), trace.dt)}


def _derivative(values: np.ndarray, dt: float, window: int = SAVGOL_WINDOW) -> np.ndarray:
    """First derivative by a quadratic least-squares fit over `window` samples (scipy's savgol_filter,
    mode 'interp': the edge samples take the derivative of the fit to the first / last window)."""
    count = len(values)
    if count < window:
        return np.gradient(values, dt) if count > 1 else np.zeros_like(values)
    offsets = np.arange(window) - window // 2
    vandermonde = np.stack([np.ones(window), offsets, offsets ** 2], 1)       # value at offset for coeffs (c0, c1, c2)
    slope_at = np.stack([np.zeros(window), np.ones(window), 2 * offsets], 1)  # derivative at each offset
    weights = slope_at @ np.linalg.pinv(vandermonde) / dt                     # (window, window)
    windows = np.lib.stride_tricks.sliding_window_view(values, window)       # (count - window + 1, window)
    half = window // 2
    out = np.empty_like(values)
    out[half:count - half] = windows @ weights[half]
    out[:half] = weights[:half] @ values[:window]
    out[count - half:] = weights[half + 1:] @ values[-window:]
    return out


def is_comfortable(signals: dict[str, np.ndarray]) -> bool:
    return all(((low <= signals[name]) & (signals[name] <= high)).all() for name, (low, high) in COMFORT_BOUNDS.items())


# ---------------------------------------------------------------------------------------------- scores


def route_completion(trace: EpisodeTrace) -> float:
    """CARLA's RC in [0, 1]: route progress over route_length, not counting progress made off-road.

    The leaderboard: "if the agent drives off-road, that percentage of the route will not be
    considered towards the computation of the route completion score". Each step's progress
    increment counts by the share of its two ends on drivable ground (trapezoid rule). (The
    leaderboard's code applies it as a factor 1 - off-route share on the score instead; the two
    agree when the route is completed. CARLA also counts driving in the oncoming lane as off
    route; our world has no lane map, so only leaving the drivable ground counts.)
    """
    if trace.steps < 2:
        return 0.0
    increments = np.diff(trace.progress)
    on_road = (trace.on_drivable[1:].astype(float) + trace.on_drivable[:-1]) / 2
    return float(np.clip((increments * on_road).sum() / trace.route_length, 0.0, 1.0))


def ego_progress(trace: EpisodeTrace, expert_progress: float | None) -> float:
    """NAVSIM's EP: the ego's progress over the expert's on the same episode, clipped to [0, 1];
    1 when the expert progresses less than 5 m. Without an expert run, route_length is the reference."""
    reference = trace.route_length if expert_progress is None else float(expert_progress)
    if not np.isfinite(reference):
        raise StackError(f"expert_progress: expected a finite number of metres or None, found {expert_progress!r}.")
    if reference < EP_MIN_EXPERT_PROGRESS_M:
        return 1.0
    return float(np.clip((trace.progress[-1] - trace.progress[0]) / reference, 0.0, 1.0))


def no_collision_term(events: list[dict]) -> float:
    """NAVSIM's NC: 0 after an at-fault collision with a vehicle, pedestrian or cyclist, 0.5 with a
    static object only, 1 without at-fault collisions (the minimum over the episode)."""
    term = 1.0
    for event in events:
        if event["at_fault"]:
            term = min(term, NC_STATIC if event["category"] == "static" else 0.0)
    return term


def carla_penalty(events: list[dict]) -> float:
    """Product of CARLA's collision penalties over the at-fault collisions.

    The leaderboard counts every collision of the ego; we count the at-fault ones, because our
    background traffic is scripted and reactive, and a scripted car running into a stopped ego
    says nothing about the policy. Cyclists count as vehicles (CARLA_PENALTIES)."""
    penalty = 1.0
    for event in events:
        if event["at_fault"]:
            penalty *= CARLA_PENALTIES["vehicle" if event["category"] == "cyclist" else event["category"]]
    return penalty


def min_speed_penalty(trace: EpisodeTrace, expert_progress: float | None, expert_seconds: float | None) -> tuple[float, float]:
    """(ratio, penalty): the ego's average speed over the expert's on the same episode, and CARLA 2.0's
    minimum-speed penalty MIN_SPEED_BASE + (1 - MIN_SPEED_BASE) x ratio when the ratio is below 1.

    Speeds are route progress over time driven (a drive that ended early is judged on the time it drove).
    No expert run, or an expert that itself progressed less than EP_MIN_EXPERT_PROGRESS_M (a ratio of small
    numbers is noise): ratio NaN, penalty 1."""
    if expert_progress is None or expert_seconds is None or expert_progress < EP_MIN_EXPERT_PROGRESS_M:
        return float("nan"), 1.0
    if not (np.isfinite(expert_seconds) and expert_seconds > 0):
        raise StackError(f"expert_seconds: expected a positive number of seconds, found {expert_seconds!r}.")
    driven = max((trace.steps - 1) * trace.dt, trace.dt)
    ratio = max(float(trace.progress[-1] - trace.progress[0]), 0.0) / driven / (float(expert_progress) / expert_seconds)
    return ratio, (MIN_SPEED_BASE + (1.0 - MIN_SPEED_BASE) * ratio if ratio < 1.0 else 1.0)


def pdm_score(no_collision: float, drivable: float, ttc: float, comfort: float, progress: float) -> float:
    """NAVSIM's PDMS = NC * DAC * (5 * TTC + 2 * C + 5 * EP) / 12 (arXiv:2406.15349, Eq. 1)."""
    weighted = (PDMS_WEIGHTS["ttc"] * ttc + PDMS_WEIGHTS["comfort"] * comfort
                + PDMS_WEIGHTS["ego_progress"] * progress) / sum(PDMS_WEIGHTS.values())
    return float(no_collision * drivable * weighted)


def score_episode(trace: EpisodeTrace, expert_progress: float | None,
                  expert_seconds: float | None = None) -> dict[str, float]:
    """Every closed-loop metric of one episode (flat dict of floats; first_collision_s NaN without one).

    driving_score = route completion x CARLA's collision penalties x the minimum-speed penalty (against the
    expert's average speed over `expert_seconds`, when given). ended_* are 1 when that infraction ended the
    drive early (the trace stops there, so route completion and ego progress count only the part driven).

    collisions* count at-fault collisions (one per agent track, `collision_events`);
    collisions_total counts every track touched. drivable_area_compliance is NAVSIM's DAC:
    1 when every step keeps all ego corners on drivable ground, else 0. max_abs_accel and
    max_abs_jerk are longitudinal (m/s^2, m/s^3), the comfort term's two most frequent failures.
    """
    events = collision_events(trace)
    at_fault = [event for event in events if event["at_fault"]]
    signals = comfort_signals(trace)
    no_collision = no_collision_term(events)
    drivable = float(trace.on_drivable.all())
    ttc = float(not ttc_violations(trace).any())
    comfort = float(is_comfortable(signals))
    progress = ego_progress(trace, expert_progress)
    completion = route_completion(trace)
    speed_ratio, speed_penalty = min_speed_penalty(trace, expert_progress, expert_seconds)
    metrics = {
        "route_completion": completion,
        "collisions": float(len(at_fault)),
        **{f"collisions_{name}": float(sum(e["category"] == name for e in at_fault))
           for name in ("vehicle", "pedestrian", "cyclist", "static")},
        "collisions_total": float(len(events)),
        "no_collision": no_collision,
        "drivable_area_compliance": drivable,
        "ttc": ttc,
        "comfort": comfort,
        "ego_progress": progress,
        "pdms": pdm_score(no_collision, drivable, ttc, comfort, progress),
        "driving_score": completion * carla_penalty(events) * speed_penalty,
        "min_speed_ratio": speed_ratio,
        "min_speed_penalty": speed_penalty,
        **{f"ended_{name}": float(trace.ended == name) for name in ENDINGS},
        "driven_s": float((trace.steps - 1) * trace.dt),
        "progress_m": float(trace.progress[-1] - trace.progress[0]),
        "max_abs_accel": float(np.abs(signals["lon_accel"]).max()),
        "max_abs_jerk": float(np.abs(signals["lon_jerk"]).max()),
        "max_abs_lat_accel": float(np.abs(signals["lat_accel"]).max()),
        "first_collision_s": at_fault[0]["time_s"] if at_fault else float("nan"),
    }
    return metrics


# ---------------------------------------------------------------------------------------------- aggregate


def aggregate(rows: list[dict]) -> dict:
    """{policy: {family | "all": {metric: {"mean", "std", "episodes"}}}}, mean ± std over seeds.

    Each seed's episodes are averaged first (for "all": every family's episodes of that seed
    together), then mean and sample standard deviation (ddof=1; NaN with a single seed, where
    there is no spread to measure) go over those per-seed means, so the spread is the run-to-run
    variation a reader can expect, not the spread between scenarios. NaN values (first_collision_s
    of an episode without a collision) are left out of a seed's mean. "episodes" counts the
    episodes behind the entry.
    """
    _check_rows(rows)
    summary: dict = {}
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = [row for row in rows if row["policy"] == policy]
        families = list(dict.fromkeys(row["family"] for row in mine))
        summary[policy] = {family: _over_seeds([row for row in mine if row["family"] == family])
                           for family in families}
        summary[policy]["all"] = _over_seeds(mine)
    return summary


ROW_KEYS = ("policy", "family", "seed", "metrics")


def _check_rows(rows) -> None:
    for number, row in enumerate(rows):
        missing = [key for key in ROW_KEYS if not isinstance(row, dict) or key not in row]
        if missing:
            raise StackError(f"aggregate: row {number} lacks {missing}; expected dicts with policy, family, seed "
                             "and metrics (score_episode's output).")


def _over_seeds(rows: list[dict]) -> dict:
    names = list(dict.fromkeys(name for row in rows for name in row["metrics"]))
    seeds = list(dict.fromkeys(row["seed"] for row in rows))
    out = {}
    for name in names:
        per_seed = []
        for seed in seeds:
            values = np.array([float(row["metrics"][name]) for row in rows
                               if row["seed"] == seed and name in row["metrics"]], dtype=np.float64)
            values = values[~np.isnan(values)]
            if values.size:
                per_seed.append(values.mean())
        per_seed = np.array(per_seed)
        mean = float(per_seed.mean()) if per_seed.size else float("nan")
        std = float(per_seed.std(ddof=1)) if per_seed.size > 1 else float("nan")
        out[name] = {"mean": mean, "std": std, "episodes": sum(name in row["metrics"] for row in rows)}
    return out


# ---------------------------------------------------------------------------------------------- the bar

BLIND_POLICIES = ("constant_velocity", "ego_rollout")
"""Policies that never look at a camera: a network that cannot beat them has learned nothing from its cameras."""
BAR_METRICS = ("driving_score", "pdms")
BAR_LEVEL = 0.90
BAR_RESAMPLES = 4000


def bootstrap_mean(values, level: float = BAR_LEVEL, resamples: int = BAR_RESAMPLES, seed: int = 0) -> dict:
    """{"mean", "low", "high", "episodes", "level"}: the mean of per-episode `values` with its percentile bootstrap
    interval (whole episodes resampled)."""
    values = np.asarray(values, np.float64)
    if not values.size:
        raise StackError("bootstrap_mean: no episodes to average; drive at least one episode")
    means = values[np.random.default_rng(seed).integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(values.mean()), "low": float(low), "high": float(high), "episodes": int(values.size),
            "level": level}


def episode_key(row: dict) -> tuple:
    """An episode's identity across policies and drives (family, seed, index): what a paired comparison pairs."""
    return row["family"], row["seed"], row.get("index", 0)


def paired_gain(rows: list[dict], policy: str, baseline: str, metric: str, level: float = BAR_LEVEL,
                resamples: int = BAR_RESAMPLES, seed: int = 0) -> dict:
    """Mean gain of `policy` over `baseline` in `metric` on the episodes both drove, with a paired bootstrap
    interval resampling whole episodes (Efron & Tibshirani 1993, ch. 13; the episodes, not the steps, are the
    independent units): {"gain", "low", "high", "episodes", "level"}. `beats` is True when the whole interval
    lies above zero."""
    mine = {episode_key(r): float(r["metrics"][metric]) for r in rows if r["policy"] == policy}
    theirs = {episode_key(r): float(r["metrics"][metric]) for r in rows if r["policy"] == baseline}
    shared = sorted(set(mine) & set(theirs))
    if not shared:
        raise StackError(f"paired_gain: {policy!r} and {baseline!r} drove no episode in common; drive them on the "
                         f"same episodes (stack drive drives every policy on the same ones)")
    interval = bootstrap_mean([mine[k] - theirs[k] for k in shared], level, resamples, seed)
    return {"policy": policy, "baseline": baseline, "metric": metric, "gain": interval["mean"],
            "low": interval["low"], "high": interval["high"], "episodes": len(shared), "level": level,
            "beats": bool(interval["low"] > 0)}


def comparison_text(comparison: dict) -> str:
    """One comparison of `closed_loop_bar` in words: what it gained, how sure, over how many episodes."""
    c = comparison
    return (f"{c['baseline']} in {c['metric']} (gain {c['gain']:+.3f}, {c['level']:.0%} interval [{c['low']:+.3f}, "
            f"{c['high']:+.3f}] over {c['episodes']} episodes; the interval must lie above 0)")


def closed_loop_bar(rows: list[dict], policy: str, baselines=BLIND_POLICIES, metrics=BAR_METRICS) -> dict:
    """The bar a driving network must clear: beat every blind baseline driven beside it in every bar metric,
    each with a paired bootstrap interval of the gain above zero. {"passed", "comparisons"}; passed is None
    when no blind baseline was driven (no bar to judge by)."""
    driven = {r["policy"] for r in rows}
    comparisons = [paired_gain(rows, policy, baseline, metric)
                   for baseline in baselines if baseline in driven for metric in metrics]
    return {"passed": all(c["beats"] for c in comparisons) if comparisons else None, "comparisons": comparisons}
