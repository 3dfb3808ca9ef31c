"""One simulated scene: town + traffic + ego, and the per-key-frame labels derived from it.

The simulation runs PAST_SECONDS before the first key frame and FUTURE_SECONDS
after the last, so every key frame has a full past and future ego trajectory.
Labels are expressed in the ego frame of `stack.rig` (x forward, y left, z up,
origin on the ground below the rear axle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from stack.sim.world.roads import LANE_WIDTH, POINT_SPACING, ROAD_HALF_WIDTH, Town, make_town
from stack.sim.world.traffic import (CLASSES, FUTURE_SECONDS, PAST_SECONDS, SIM_DT, SIZES, Agent, Resampling, Route,
                                _make_route, pedestrian_walkway, step, vehicle_route)
from stack.kinematics import WAYPOINT_STEP_S
from stack.metrics.detection import ATTRIBUTES
from stack.pipeline import AGENT_CLASS_MIX

EGO_SIZE = (4.6, 1.9, 1.6)
REAR_AXLE_OFFSET = 1.3
"""Ego box centre is this far ahead of the rear axle (the ego frame origin)."""


@dataclass
class Scene:
    town: Town
    ego: Agent
    agents: list
    key_steps: np.ndarray
    """Simulation step index of every key frame."""
    light: np.ndarray
    """Sun azimuth, sun elevation, exposure, white-balance tint r, b (rendering look of the scene)."""


class _Routes:
    """The vehicle routes of one town, each built once.

    Placing agents near the ego rejects most random spawns, and every try draws a route:
    building it (lane offsets, Bézier turn, resampling) was a sixth of the generator's time.
    A route is a pure function of (entry, exit, lateral) and is never mutated, so agents
    share it; the random draws, and so the dataset, are unchanged.
    """

    def __init__(self, town: Town):
        self.town, self.built = town, {}

    def random(self, rng: np.random.Generator, lateral: float = LANE_WIDTH / 2) -> Route:
        entry = int(rng.integers(len(self.town.arms)))
        exits = [k for k in range(len(self.town.arms)) if k != entry]
        exit_ = exits[int(rng.integers(len(exits)))]  # rng.choice(exits)'s draw, without its conversions
        key = (entry, exit_, lateral)
        if key not in self.built:
            self.built[key] = vehicle_route(self.town, entry, exit_, lateral)
        return self.built[key]


def _spawn(kind: str, routes: _Routes, rng: np.random.Generator, track_id: int) -> Agent:
    return _draw(kind, routes, rng, track_id)[1]()


def _draw(kind: str, routes: _Routes, rng: np.random.Generator, track_id: int) -> tuple[np.ndarray, Callable]:
    """(start position, the agent's constructor) of one random agent: a pedestrian's route is resampled
    in full only when it is built, since placement rejects most tries on the start position alone."""
    size = tuple(np.array(SIZES[kind]) * rng.uniform(0.92, 1.08, 3))
    colour = int(rng.integers(0, 12))
    if kind == "pedestrian":
        walkway = Resampling(pedestrian_walkway(routes.town, rng))
        speed = rng.uniform(1.0, 1.6)
        s = rng.uniform(0, walkway.length * 0.8)
        return walkway.at(s), lambda: Agent(kind, _make_route(walkway.polyline), s, speed, speed, size, colour,
                                            track_id)
    if kind == "car" and rng.random() < 0.35:  # parked in the parking strip
        route = routes.random(rng, lateral=(LANE_WIDTH + ROAD_HALF_WIDTH) / 2 + 0.2)
        s = rng.uniform(0, route.junction[0] - 12.0) if rng.random() < 0.5 else rng.uniform(route.junction[1] + 12, route.length)
        agent = Agent(kind, route, s, 0.0, 0.0, size, colour, track_id, parked=True)
    else:
        lateral = LANE_WIDTH / 2 + (1.0 if kind == "cyclist" else 0.0)
        route = routes.random(rng, lateral)
        desired = rng.uniform(4.0, 6.0) if kind == "cyclist" else rng.uniform(7.0, 12.0)
        agent = Agent(kind, route, rng.uniform(0, route.length * 0.7), desired * rng.uniform(0.5, 1.0), desired, size,
                      colour, track_id)
    return agent.route.at(agent.s)[0], lambda: agent


def _clear_of(agent: Agent, placed: list) -> bool:
    xy, _ = agent.route.at(agent.s)
    for other in placed:
        other_xy, _ = other.route.at(other.s)
        if np.linalg.norm(xy - other_xy) < (agent.size[0] + other.size[0]) / 2 + 2.0:
            return False
    return True


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    """`np.linalg.norm(a - b)` of two points, op for op (the square root of the difference's dot product),
    without the generality that made it a tenth of agent placement."""
    difference = a - b
    return math.sqrt(difference.dot(difference))


def _place_agents(routes: _Routes, ego: Agent, count: int, rng: np.random.Generator, radius: float,
                  class_mix: dict) -> list:
    """`count` agents within `radius` metres of the ego start so the cameras see them, none overlapping.

    An agent that finds no free spot in 60 tries is left out (crowded small radii give fewer).
    The test is `_clear_of`'s, on the positions of those placed kept as they are placed."""
    ego_xy, _ = ego.route.at(ego.s)
    kinds, weights = list(class_mix), np.array(list(class_mix.values()), dtype=float)
    placed: list = []
    taken = [(ego_xy, ego.size[0])]  # (position, length) of the ego and every agent placed
    for track_id in range(1, count + 1):
        kind = str(rng.choice(kinds, p=weights / weights.sum()))
        for _ in range(60):
            xy, build = _draw(kind, routes, rng, track_id)
            if _distance(xy, ego_xy) >= radius:
                continue
            agent = build()
            if not any(_distance(xy, other_xy) < (agent.size[0] + length) / 2 + 2.0 for other_xy, length in taken):
                placed.append(agent)
                taken.append((xy, agent.size[0]))
                break
    return placed


def simulate(rng: np.random.Generator, frames: int, rate_hz: float, agent_count: int,
             spawn_radius: float = 70.0, class_mix: dict | None = None) -> Scene:
    """Build a town, place ego and agents, and run the traffic until FUTURE_SECONDS after the last key frame."""
    town = make_town(rng)
    routes = _Routes(town)
    ego_route = routes.random(rng)
    ego_start = max(ego_route.junction[0] - rng.uniform(20.0, 70.0), 0.0)
    desired = rng.uniform(8.0, 11.0)
    ego = Agent("car", ego_route, ego_start, desired * 0.8, desired, EGO_SIZE, 0, 0)
    agents = _place_agents(routes, ego, agent_count, rng, spawn_radius, class_mix or AGENT_CLASS_MIX)
    everyone = [ego] + agents
    for agent in everyone:
        xy, heading = agent.route.at(agent.s)
        agent.history.append((xy[0], xy[1], heading, agent.speed, 0.0))
    key_interval = 1.0 / rate_hz / SIM_DT
    first = int(round(PAST_SECONDS / SIM_DT))
    key_steps = np.round(first + np.arange(frames) * key_interval).astype(int)
    total = key_steps[-1] + int(round(FUTURE_SECONDS / SIM_DT))
    for _ in range(total):
        step(everyone)
    light = np.array([rng.uniform(-math.pi, math.pi), rng.uniform(0.25, 1.1), rng.uniform(0.85, 1.15),
                      rng.uniform(0.92, 1.08), rng.uniform(0.92, 1.08)])
    return Scene(town, ego, agents, key_steps, light)


def ego_pose(scene: Scene, step_index: int) -> np.ndarray:
    """4x4 world-from-ego transform (rear axle on the ground) at a simulation step."""
    x, y, yaw = scene.ego.history[step_index][:3]
    c, s = math.cos(yaw), math.sin(yaw)
    pose = np.eye(4)
    pose[:2, :2] = [[c, -s], [s, c]]
    pose[:2, 3] = [x - c * REAR_AXLE_OFFSET, y - s * REAR_AXLE_OFFSET]
    return pose


def _to_ego(pose: np.ndarray, xy: np.ndarray) -> np.ndarray:
    rotation, origin = pose[:2, :2], pose[:2, 3]
    return (xy - origin) @ rotation


def ego_labels(scene: Scene, step_index: int) -> dict:
    """Ego status, command and trajectories at one key frame (see stack.batch)."""
    pose = ego_pose(scene, step_index)
    stride = int(round(WAYPOINT_STEP_S / SIM_DT))
    rear = np.array([ego_pose(scene, k)[:2, 3] for k in range(len(scene.ego.history))])
    past_steps = [step_index - stride * k for k in range(int(PAST_SECONDS / WAYPOINT_STEP_S), 0, -1)]
    future_steps = [step_index + stride * k for k in range(1, int(FUTURE_SECONDS / WAYPOINT_STEP_S) + 1)]
    history = scene.ego.history
    yaw_rate = (history[step_index + 1][2] - history[step_index - 1][2]) / (2 * SIM_DT)
    route, s = scene.ego.route, _arc_length_at(scene, step_index)
    entry, exit_ = route.junction
    command = route.turn if (entry - 30.0 < s < exit_) else 1
    return {
        "ego": np.array([history[step_index][3], history[step_index][4], yaw_rate], np.float32),
        "command": np.array([command], np.int64),
        "past": _to_ego(pose, rear[past_steps]).astype(np.float32),
        "future": _to_ego(pose, rear[future_steps]).astype(np.float32),
    }


def _arc_length_at(scene: Scene, step_index: int) -> float:
    xy = np.array(scene.ego.history[step_index][:2])
    return float(np.argmin(np.linalg.norm(scene.ego.route.points - xy, axis=1))) * POINT_SPACING


MOVING_ABOVE_M_S = 0.2
"""A road user faster than this is `*.moving`, else stopped or standing: the speed CenterPoint's nuScenes output
(det3d `nuscenes.py`, `output_to_nusc_box`) uses to tell its moving from its standing attributes."""


def agent_attribute(agent: Agent, speed: float) -> int:
    """The nuScenes attribute (index into `stack.metrics.detection.ATTRIBUTES`) that the world knows exactly:
    a car or truck is parked (placed in the parking strip, never driven), moving, or stopped (in traffic); a
    pedestrian moving or standing (none sits or lies down here); a cyclist always rides its cycle. `parked` is
    the agent's state now: a recorded scene's parked cars never leave (only an interactive script pulls one out,
    and its frames are rendered as it goes)."""
    moving = speed > MOVING_ABOVE_M_S
    if agent.kind == "pedestrian":
        name = "pedestrian.moving" if moving else "pedestrian.standing"
    elif agent.kind == "cyclist":
        name = "cycle.with_rider"
    else:
        name = "vehicle.parked" if agent.parked else "vehicle.moving" if moving else "vehicle.stopped"
    return ATTRIBUTES.index(name)


def agent_boxes(scene: Scene, step_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(boxes (A, 9) in the ego frame, [class index, track id, attribute] (A, 3)) for every agent at a step."""
    pose = ego_pose(scene, step_index)
    ego_yaw = scene.ego.history[step_index][2]
    rows, ids = [], []
    for agent in scene.agents:
        x, y, yaw, speed, _ = agent.history[step_index]
        centre = _to_ego(pose, np.array([x, y]))
        heading = math.remainder(yaw - ego_yaw, 2 * math.pi)
        length, width, height = agent.size
        rows.append([centre[0], centre[1], height / 2, length, width, height, heading,
                     speed * math.cos(heading), speed * math.sin(heading)])
        ids.append([CLASSES.index(agent.kind), agent.track_id, agent_attribute(agent, speed)])
    return np.array(rows, np.float32).reshape(-1, 9), np.array(ids, np.int32).reshape(-1, 3)
