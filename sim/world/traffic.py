"""Traffic of one scene: routes through the junction, agents, and the expert-driven ego vehicle.

Vehicles and cyclists follow routes (incoming lane → a Bézier turn through the
junction → outgoing lane) with the Intelligent Driver Model (Treiber, Hennecke &
Helbing 2000, https://arxiv.org/abs/cond-mat/0002177) for car following: the
leader is whatever agent stands in the corridor ahead on the route (a slower
car, a cyclist, a pedestrian on a crossing). Curves cap the desired speed by a
lateral-acceleration limit, and vehicles about to enter the junction yield to
whoever is in it or closer to it (first come, first served; never a deadlock).
Pedestrians walk the sidewalks and some cross at the zebra crossings. Cars park
in the parking strips, which hides what is behind them.

The ego vehicle is one of these vehicles with privileged knowledge (the expert
planner); its states give the past/future trajectories, ego status and the
high-level command of every key frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from stack.sim.world.roads import (JUNCTION_RADIUS, LANE_WIDTH, POINT_SPACING, ROAD_HALF_WIDTH, SIDEWALK_OUTER,
                              Town)

CLASSES = ("car", "truck", "pedestrian", "cyclist")
"""Agent classes, by index (3D box labels in shards)."""
SIZES = {"car": (4.5, 1.9, 1.55), "truck": (8.0, 2.5, 3.4), "pedestrian": (0.6, 0.6, 1.75), "cyclist": (1.8, 0.6, 1.75)}
"""Nominal (length, width, height) per class, metres; each agent varies them by +/- 8 %."""
SIM_DT = 0.1
"""Simulation step, seconds."""
PAST_SECONDS, FUTURE_SECONDS = 2.0, 3.0
TURN_ANGLE = math.radians(30.0)
STOP_LINE = 4.2
"""Stop line distance before the junction entry (beyond the zebra crossing), metres."""


@dataclass
class Route:
    """A path resampled every POINT_SPACING metres, with the junction's arc-length span and turn."""

    points: np.ndarray
    headings: np.ndarray
    curvature: np.ndarray
    junction: tuple = (math.inf, math.inf)
    """(entry, exit) arc length of the junction part; infinite for routes that avoid it."""
    turn: int = 1
    """0 left, 1 straight, 2 right (stack.batch.COMMANDS)."""
    entry_arm: int = -1
    """Arm the route enters the junction from (-1: not a vehicle route)."""

    @property
    def length(self) -> float:
        return (len(self.points) - 1) * POINT_SPACING

    def at(self, s: float) -> tuple[np.ndarray, float]:
        """(x, y) and heading at arc length `s` (clamped to the route)."""
        position = min(max(s / POINT_SPACING, 0.0), len(self.points) - 1.001)
        i, frac = int(position), position - int(position)
        xy = self.points[i] * (1 - frac) + self.points[i + 1] * frac
        return xy, float(self.headings[i])


def _make_route(polyline: np.ndarray, junction=(math.inf, math.inf), turn=1, entry_arm=-1) -> Route:
    steps = np.linalg.norm(np.diff(polyline, axis=0), axis=1)
    s = np.concatenate([[0.0], np.cumsum(steps)])
    grid = np.arange(0.0, s[-1], POINT_SPACING)
    points = np.stack([np.interp(grid, s, polyline[:, k]) for k in range(2)], axis=1)
    delta = np.gradient(points, axis=0)
    headings = np.unwrap(np.arctan2(delta[:, 1], delta[:, 0]))
    curvature = np.gradient(headings) / POINT_SPACING
    return Route(points, headings, curvature, junction, turn, entry_arm)


def _lane(town: Town, arm: int, offset: float) -> np.ndarray:
    return town.arms[arm] + town.normals(arm) * offset


def vehicle_route(town: Town, entry: int, exit_: int, lateral: float = LANE_WIDTH / 2) -> Route:
    """Incoming lane of arm `entry` → turn → outgoing lane of arm `exit_`; `lateral` from the centreline."""
    start = int(JUNCTION_RADIUS / POINT_SPACING)
    incoming = _lane(town, entry, lateral)[start:][::-1]
    outgoing = _lane(town, exit_, -lateral)[start:]
    a, b = incoming[-1], outgoing[0]
    direction_in, direction_out = a - incoming[-2], outgoing[1] - b
    direction_in, direction_out = direction_in / np.linalg.norm(direction_in), direction_out / np.linalg.norm(direction_out)
    reach = 0.39 * np.linalg.norm(b - a)  # cubic Bezier handle that approximates a circular quarter arc
    t = np.linspace(0.0, 1.0, 40)[1:-1, None]
    p1, p2 = a + direction_in * reach, b - direction_out * reach
    bezier = (1 - t) ** 3 * a + 3 * (1 - t) ** 2 * t * p1 + 3 * (1 - t) * t ** 2 * p2 + t ** 3 * b
    heading_in, heading_out = (math.atan2(d[1], d[0]) for d in (direction_in, direction_out))
    change = math.remainder(heading_out - heading_in, 2 * math.pi)
    turn = 0 if change > TURN_ANGLE else 2 if change < -TURN_ANGLE else 1
    entry_s = (len(incoming) - 1) * POINT_SPACING
    return _make_route(np.concatenate([incoming, bezier, outgoing]), (entry_s, entry_s + 2 * reach * 1.2), turn, entry)


def pedestrian_route(town: Town, rng: np.random.Generator) -> Route:
    """Along one sidewalk; sometimes toward the junction and across the zebra crossing."""
    return _make_route(pedestrian_walkway(town, rng))


def pedestrian_walkway(town: Town, rng: np.random.Generator) -> np.ndarray:
    """The polyline `pedestrian_route` resamples (the same random draws)."""
    arm = int(rng.integers(len(town.arms)))
    side = rng.choice([-1.0, 1.0])
    lateral = (ROAD_HALF_WIDTH + SIDEWALK_OUTER) / 2 + rng.uniform(-1.0, 1.0)  # people do not walk in single file
    walkway = _lane(town, arm, side * lateral)
    start = int((JUNCTION_RADIUS + 2.0) / POINT_SPACING)
    if rng.random() < 0.5:
        toward = walkway[start:][::-1]
        other = _lane(town, arm, -side * lateral)[start:]
        return np.concatenate([toward, other])
    return walkway[start:] if rng.random() < 0.5 else walkway[start:][::-1]


class Resampling:
    """`length` and `at` of `_make_route(polyline)` without building the route (its headings and curvature).

    Agent placement rejects most tries on where they start: a rejected pedestrian needs only this.
    Same arithmetic as `_make_route` and `Route.at` (np.interp at the two grid points `at` blends)."""

    def __init__(self, polyline: np.ndarray):
        self.polyline = polyline
        self.arc = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(polyline, axis=0), axis=1))])
        self.grid = np.arange(0.0, self.arc[-1], POINT_SPACING)
        self.length = (len(self.grid) - 1) * POINT_SPACING

    def at(self, s: float) -> np.ndarray:
        position = min(max(s / POINT_SPACING, 0.0), len(self.grid) - 1.001)
        i, frac = int(position), position - int(position)
        pair = np.stack([np.interp(self.grid[i:i + 2], self.arc, self.polyline[:, k]) for k in range(2)], axis=1)
        return pair[0] * (1 - frac) + pair[1] * frac


@dataclass
class Agent:
    kind: str
    route: Route
    s: float
    speed: float
    desired_speed: float
    size: tuple
    colour: int
    track_id: int
    parked: bool = False
    history: list = field(default_factory=list)
    """(x, y, yaw, speed, accel) per simulation step."""
    controlled: bool = False
    """Driven from outside (the closed-loop ego): `step` reads its state and never moves it."""
    forced_accel: float | None = None
    """Acceleration a scripted event imposes for the next step instead of the rules (None: follow the rules)."""


def _idm(speed: float, desired: float, gap: float, leader_speed: float) -> float:
    """IDM acceleration (a = 1.5 m/s^2, b = 2.5 m/s^2, T = 1.4 s, s0 = 2.5 m)."""
    a, b, headway, s0 = 1.5, 2.5, 1.4, 2.5
    free = 1.0 - (speed / max(desired, 0.1)) ** 4
    if not math.isfinite(gap):
        return a * free
    wanted = s0 + max(0.0, speed * headway + speed * (speed - leader_speed) / (2 * math.sqrt(a * b)))
    return a * (free - (wanted / max(gap, 0.1)) ** 2)


def _curve_speed(agent: Agent) -> float:
    """Desired speed that keeps lateral acceleration below 2.5 m/s^2 in curves ahead, braking at 2 m/s^2 to reach them."""
    i = int(agent.s / POINT_SPACING)
    ahead = np.abs(agent.route.curvature[i:i + int(40 / POINT_SPACING)])
    if not len(ahead):
        return agent.desired_speed
    distance = np.arange(len(ahead)) * POINT_SPACING
    reachable = np.sqrt(2.5 / np.maximum(ahead, 1e-4) + 2 * 2.0 * distance)
    return min(agent.desired_speed, float(reachable.min()))


def _leader(agent: Agent, others: list, positions: np.ndarray) -> tuple[float, float]:
    """(gap, speed) of the nearest agent in the corridor ahead on the route."""
    ahead = np.arange(agent.s + 1.0, min(agent.s + 45.0, agent.route.length), 1.0)
    if not len(ahead) or not len(others):
        return math.inf, 0.0
    samples = agent.route.points[(ahead / POINT_SPACING).astype(int)]
    distance = np.linalg.norm(samples[:, None, :] - positions[None, :, :], axis=2)
    near = distance < np.array([_corridor_reach(other) for other in others])[None, :]
    return _nearest_in_corridor(agent, others, ahead, near.any(axis=0), near.argmax(axis=0))


def _corridor_reach(other: Agent) -> float:
    """How close to a route sample an agent counts as in the corridor (narrow road users pass closer)."""
    return 1.3 if other.kind in ("pedestrian", "cyclist") else 1.6


def _nearest_in_corridor(agent: Agent, others: list, ahead: np.ndarray, in_corridor: np.ndarray,
                         first_near: np.ndarray) -> tuple[float, float]:
    """(gap, speed) of the nearest of `others` in the corridor, given the route samples `ahead` (arc lengths),
    which others come within reach of one, and the first such sample (per other)."""
    route, best = agent.route, (math.inf, 0.0)
    for j in np.flatnonzero(in_corridor):  # only agents in the corridor, in their original order
        other = others[j]
        other_heading = other.history[-1][2]
        path_heading = route.headings[int(ahead[first_near[j]] / POINT_SPACING)]
        aligned = math.cos(other_heading - path_heading) > 0.5
        if other.kind in ("car", "truck") and not aligned and other.speed > 0.5:
            continue  # crossing traffic is handled by the junction rule
        gap = ahead[first_near[j]] - agent.s - (agent.size[0] + other.size[0]) / 2
        if gap < best[0]:
            best = (gap, other.speed if aligned else 0.0)
    return best


def _corridor_samples(movers: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every mover at once: (arc lengths ahead (M, K), valid (M, K), route points there (M, K, 2)).

    Row m holds exactly `np.arange(s + 1, min(s + 45, length), 1.0)` of mover m, padded: numpy fills a
    float arange as start, start + step, then start + i * ((start + step) - start), and so does this."""
    s = np.array([agent.s for agent in movers], dtype=np.float64)
    start, stop = s + 1.0, np.minimum(s + 45.0, np.array([agent.route.length for agent in movers], dtype=np.float64))
    second = start + 1.0
    counts = np.maximum(np.ceil((stop - start) / 1.0), 0).astype(np.int64)  # 45, not 44, where s + 45 rounds up
    steps = np.arange(max(int(counts.max()), 2))
    ahead = start[:, None] + steps[None, :] * (second - start)[:, None]
    ahead[:, 0], ahead[:, 1] = start, second
    valid = steps[None, :] < counts[:, None]
    samples = np.zeros(ahead.shape + (2,))
    for row, (agent, count) in enumerate(zip(movers, counts.tolist())):
        samples[row, :count] = agent.route.points[(ahead[row, :count] / POINT_SPACING).astype(int)]
    return ahead, valid, samples


def _leaders(agents: list, movers: list, rows: list, positions: np.ndarray) -> list:
    """`_leader` of every mover (`agents[rows[m]]`) among the others, or among the vehicles for a pedestrian.

    One distance tensor for all movers instead of a matrix and the per-agent lists each: same arithmetic,
    element for element, so the same leaders (the simulation is unchanged, bit for bit)."""
    ahead, valid, samples = _corridor_samples(movers)
    reach = np.array([_corridor_reach(a) for a in agents])
    dx = samples[:, :, 0, None] - positions[None, None, :, 0]
    dy = samples[:, :, 1, None] - positions[None, None, :, 1]
    distance = np.sqrt(dx * dx + dy * dy)  # np.linalg.norm's arithmetic, without its slow reduce over 2 numbers
    pedestrian = np.array([a.kind == "pedestrian" for a in agents])
    excluded = pedestrian[rows][:, None] & pedestrian[None, :]  # pedestrians stop for vehicles only
    excluded[np.arange(len(rows)), rows] = True  # nobody leads itself
    near = (distance < reach[None, None, :]) & valid[:, :, None] & ~excluded[:, None, :]
    in_corridor, first_near = near.any(axis=1), near.argmax(axis=1)
    anyone = in_corridor.any(axis=1).tolist()
    return [_nearest_in_corridor(agent, agents, ahead[m], in_corridor[m], first_near[m]) if anyone[m]
            else (math.inf, 0.0) for m, agent in enumerate(movers)]


def _junction_gap(agent: Agent, vehicles: list) -> float:
    """Distance to a virtual stop line when the junction is not ours to enter, else infinity."""
    entry = agent.route.junction[0]
    to_entry = entry - agent.s
    if not 0.0 < to_entry < 25.0:
        return math.inf
    for other in vehicles:
        if other is agent or other.parked:
            continue
        other_to_entry = other.route.junction[0] - other.s
        inside = other.route.junction[0] <= other.s <= other.route.junction[1]
        earlier = 0.0 < other_to_entry < to_entry or (other_to_entry == to_entry and other.track_id < agent.track_id)
        same_approach = other.route.entry_arm == agent.route.entry_arm  # car following orders those
        if inside or (earlier and other_to_entry < 12.0 and not same_approach):
            return max(to_entry - STOP_LINE - agent.size[0] / 2, 0.1)
    return math.inf


def step(agents: list, dt: float = SIM_DT) -> None:
    """Advance every agent by `dt` and append its new state to its history.

    A `controlled` agent (the closed-loop ego) is seen by the others where its last history entry puts it,
    but neither moved nor appended to: whoever drives it does that. An agent with `forced_accel` set
    follows its script instead of the rules for this step."""
    positions = np.array([a.history[-1][:2] for a in agents]).reshape(-1, 2)
    vehicles = [a for a in agents if a.kind != "pedestrian"]
    rows = [k for k, a in enumerate(agents) if not (a.parked or a.controlled or a.forced_accel is not None)]
    leaders = dict(zip(rows, _leaders(agents, [agents[k] for k in rows], rows, positions))) if rows else {}
    accelerations = []
    for index, agent in enumerate(agents):
        if agent.parked or agent.controlled:
            accelerations.append(0.0)
            continue
        if agent.forced_accel is not None:
            accelerations.append(float(agent.forced_accel))
            continue
        gap, leader_speed = leaders[index]
        if agent.kind == "pedestrian":  # walk at the desired pace; stop (within a step) for a vehicle in the way
            accelerations.append(((0.0 if gap < 1.0 else agent.desired_speed) - agent.speed) / dt)
            continue
        junction = _junction_gap(agent, vehicles)
        if junction < gap:
            gap, leader_speed = junction, 0.0
        accelerations.append(float(np.clip(_idm(agent.speed, _curve_speed(agent), gap, leader_speed), -7.0, 2.5)))
    for agent, accel in zip(agents, accelerations):
        if agent.controlled:
            continue
        speed = max(agent.speed + accel * dt, 0.0)
        accel = (speed - agent.speed) / dt
        agent.s = min(agent.s + (agent.speed + speed) / 2 * dt, agent.route.length)
        agent.speed = speed if agent.s < agent.route.length else 0.0
        xy, heading = agent.route.at(agent.s)
        agent.history.append((xy[0], xy[1], heading, agent.speed, accel))
