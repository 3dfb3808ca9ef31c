"""The world stepped in time with the ego driven from outside: the closed loop's simulator.

The same town, routes, traffic rules (`stack.sim.world.traffic`) and renderer
(`stack.sim.world.frame`) as the recorded scenes, but the ego is a `controlled`
agent: a policy places it every step (`set_ego`) and every other road user then
advances by one step seeing it there, so IDM followers brake behind it, junction
yielding counts it and pedestrians stop for it. Scenario events (a lead car
braking, a pedestrian stepping out, a parked car pulling out) are `Script`s:
plain data, so a world pickles into evaluation worker processes.

Poses: `set_ego`/`ego_state` speak rear-axle poses (the ego frame's origin, as
the planner's waypoints); agent histories store box centres, REAR_AXLE_OFFSET
ahead of the rear axle, as in recorded scenes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import numpy as np

from stack.sim.world.roads import POINT_SPACING, SEG, Town, ground_class_at
from stack.sim.world.scene import EGO_SIZE, REAR_AXLE_OFFSET, Scene, _clear_of, _Routes, _spawn
from stack.sim.world.traffic import SIM_DT, Agent, Route, _curve_speed, _idm, _junction_gap, _leader, step

DRIVABLE = (SEG["road"], SEG["lane_marking"])
"""Ground classes a vehicle may drive on: lanes, parking strips, zebra crossings and the junction."""
Routes = _Routes
PREDICTION_STEP_S = 0.5
"""Time step of the expert's predictions of the other road users."""
"""Vehicle routes of one town, each built once (shared with recorded scenes)."""


@dataclass(frozen=True)
class Script:
    """A scripted road user: `before` until the trigger fires, then `after`.

    Behaviours: "rules" (traffic rules as usual), "hold" (stand still), "brake" (decelerate at `decel`
    to a stop, then stand), "walk" (move at `speed` whatever is in the way: crossing pedestrians in
    scenarios do not yield, that is their point). The trigger fires at `after_s` seconds, or when the
    ego's box centre comes within `ego_within_m` metres of the agent, whichever is first.
    """

    agent: int
    """Track id of the scripted agent."""
    before: str = "rules"
    after: str = "rules"
    after_s: float = math.inf
    ego_within_m: float = -1.0
    decel: float = 6.0
    speed: float = 1.4

    def __post_init__(self):
        for name in ("before", "after"):
            if getattr(self, name) not in BEHAVIOURS:
                raise ValueError(f"Script.{name} = {getattr(self, name)!r}; expected one of {', '.join(BEHAVIOURS)}")


BEHAVIOURS = ("rules", "hold", "brake", "walk")


def _behaviour_accel(agent: Agent, behaviour: str, script: Script, dt: float) -> float | None:
    if behaviour == "rules":
        return None
    if behaviour == "hold":
        return -agent.speed / dt
    if behaviour == "brake":
        return max(-script.decel, -agent.speed / dt)
    return (script.speed - agent.speed) / dt  # walk


def project(route: Route, xy: np.ndarray, near_s: float, window: tuple = (-10.0, 25.0)) -> float:
    """Arc length of the route point nearest `xy` within `window` metres of `near_s` (routes may loop back)."""
    low = max(int((near_s + window[0]) / POINT_SPACING), 0)
    high = min(int((near_s + window[1]) / POINT_SPACING) + 1, len(route.points))
    if high <= low:
        low, high = 0, len(route.points)
    nearest = int(np.argmin(np.linalg.norm(route.points[low:high] - xy, axis=1)))
    return (low + nearest) * POINT_SPACING


class InteractiveWorld:
    """One closed-loop episode's world: town, ego route, road users and their scripts (see the module doc)."""

    def __init__(self, town: Town, ego_route: Route, ego_s: float, ego_speed: float, ego_desired: float,
                 agents: list, light: np.ndarray, seed_words: tuple, scripts: tuple = (), duration_s: float = 8.0,
                 dt: float = SIM_DT):
        self.town, self.ego_route, self.light, self.dt = town, ego_route, light, dt
        self.seed_words, self.scripts = tuple(int(w) for w in seed_words), tuple(scripts)
        self.ego = Agent("car", ego_route, ego_s, ego_speed, ego_desired, EGO_SIZE, 0, 0, controlled=True)
        self.agents = list(agents)
        self.step_index = 0
        self.start_s = ego_s
        self._fired: dict = {}
        self.camera_sight: frozenset | None = None
        """Track ids the cameras have shown in this episode (set by `stack.sim.recording.LabelledFrames`)."""
        for agent in [self.ego] + self.agents:
            xy, heading = agent.route.at(agent.s)
            agent.history.append((float(xy[0]), float(xy[1]), heading, agent.speed, 0.0))
        self._ground = {}
        self.goal_s = self._expert_reach(duration_s)

    # -- state --------------------------------------------------------------------------------------

    @property
    def time_s(self) -> float:
        return self.step_index * self.dt

    def ego_state(self) -> tuple:
        """(x_rear, y_rear, yaw, speed, accel) of the ego now, world frame."""
        x, y, yaw, speed, accel = self.ego.history[-1]
        return (x - REAR_AXLE_OFFSET * math.cos(yaw), y - REAR_AXLE_OFFSET * math.sin(yaw), yaw, speed, accel)

    def set_ego(self, x_rear: float, y_rear: float, yaw: float, speed: float, accel: float) -> None:
        """Place the ego for the current step (before `step`); its route position is its projection."""
        centre = np.array([x_rear + REAR_AXLE_OFFSET * math.cos(yaw), y_rear + REAR_AXLE_OFFSET * math.sin(yaw)])
        self.ego.s = project(self.ego_route, centre, self.ego.s)
        self.ego.speed = max(float(speed), 0.0)
        self.ego.history[-1] = (float(centre[0]), float(centre[1]), float(yaw), self.ego.speed, float(accel))

    def step(self) -> None:
        """Advance every other road user by dt (seeing the ego where `set_ego` put it); fire scripts."""
        self._apply_scripts()
        step([self.ego] + self.agents, self.dt)
        x, y, yaw, speed, accel = self.ego.history[-1]  # the ego's new step: constant velocity until set_ego places it
        travelled = speed * self.dt
        self.ego.history.append((x + travelled * math.cos(yaw), y + travelled * math.sin(yaw), yaw, speed, accel))
        self.step_index += 1

    def _apply_scripts(self) -> None:
        by_id = {agent.track_id: agent for agent in self.agents}
        ego_xy = np.array(self.ego.history[-1][:2])
        for script in self.scripts:
            agent = by_id[script.agent]
            if script.agent not in self._fired:
                near = np.hypot(*(np.array(agent.history[-1][:2]) - ego_xy)) <= script.ego_within_m
                if near or self.time_s >= script.after_s:
                    self._fired[script.agent] = self.step_index
            behaviour = script.after if script.agent in self._fired else script.before
            agent.forced_accel = _behaviour_accel(agent, behaviour, script, self.dt)

    def fired_at(self, track_id: int) -> int | None:
        """Step at which the script of agent `track_id` fired (None: not yet)."""
        return self._fired.get(track_id)

    def command(self) -> int:
        """High-level command now: the route's turn from 30 m before the junction to its exit, else straight."""
        entry, exit_ = self.ego_route.junction
        return self.ego_route.turn if entry - 30.0 < self.ego.s < exit_ else 1

    def route_progress(self) -> float:
        """Arc length (m) of the ego's projection on its route."""
        return float(self.ego.s)

    def agents_now(self) -> dict:
        """Every other road user now: boxes (A,5) x, y, yaw, length, width (world), speed, classes, static, ids."""
        rows = [(*agent.history[-1][:3], agent.size[0], agent.size[1]) for agent in self.agents]
        return {"boxes": np.array(rows, np.float64).reshape(-1, 5),
                "speed": np.array([agent.history[-1][3] for agent in self.agents], np.float64),
                "classes": [agent.kind for agent in self.agents],
                "static": np.array([agent.parked for agent in self.agents], bool),
                "track_ids": np.array([agent.track_id for agent in self.agents], np.int64)}

    def on_drivable(self, xy: np.ndarray) -> np.ndarray:
        """(K,) True where the ground under world points (K,2) is drivable (DRIVABLE classes)."""
        return np.isin(ground_class_at(self.town.ground, np.asarray(xy, np.float64).reshape(-1, 2)), DRIVABLE)

    # -- sensors ------------------------------------------------------------------------------------

    def render(self, rig, device="cpu") -> dict:
        """The cameras now: render_frame's images (N,H,W,3) uint8, intrinsics and cam_to_ego.

        Sensor noise is seeded from the world's seed words and the step, so a replay renders the same pixels."""
        frame = self.render_labelled(rig, device)
        return {name: frame[name] for name in ("images", "intrinsics", "cam_to_ego")}

    def render_labelled(self, rig, device="cpu") -> dict:
        """Everything `render_frame` gives a recorded key frame: the cameras and their exact labels (depth,
        semantic and instance maps, 3D and 2D boxes with visibility), for training on closed-loop states."""
        from stack.sim.world.frame import TorchGround, render_frame  # torch only for policies that look

        key = str(device)
        if key not in self._ground:
            self._ground[key] = TorchGround(self.town.ground, self.seed_words[-1] * 100003 + self.seed_words[-2], device)
        scene = Scene(self.town, self.ego, self.agents, np.array([self.step_index]), self.light)
        noise = np.random.default_rng([*self.seed_words, 0xCA3E7A, self.step_index])
        return render_frame(scene, self.step_index, rig, self._ground[key], noise, device)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_ground"] = {}  # torch tensors of the ground raster: rebuilt where the world is rendered
        return state

    # -- the privileged expert ----------------------------------------------------------------------

    def expert_plan(self, steps: int = 6, step_s: float = 0.5, sees=None) -> np.ndarray:
        """(steps, 2) rear-axle waypoints in the current ego frame: IDM along the route, seeing every road user
        (or, with `sees`, only the road users whose track ids it holds: the hygienic teacher of
        `stack.sim.recording`, which reacts to nobody the cameras do not show).

        The recorded ego's own rule (IDM car following with its parameters, the curve speed limit and the
        junction rule), rolled out over the horizon. Unlike the traffic rule, which finds its leader on the
        current state, the expert predicts every road user ahead of it along its route (`_predicted_positions`)
        and, at every rollout substep, treats everywhere one will be from then to the horizon as occupied: a
        pedestrian stepping toward the lane or a car pulling out is braked for before it is in the corridor,
        and the expert never plans to slip past a crossing pedestrian (the current-state leader would, and the
        tracker's lag turns that gamble into collisions). The junction rule is evaluated on the current state
        and its stop line held for the horizon (priority is decided now, as the recorded ego decides it).
        """
        substeps = max(int(round(step_s / self.dt)), 1)
        states = self._rollout(self.ego.s, self.ego.speed, steps * substeps, steps * substeps * self.dt, sees)
        s_list = [arc for arc, _ in states[substeps - 1::substeps][:steps]]
        x, y, yaw, _, _ = self.ego_state()
        c, s = math.cos(yaw), math.sin(yaw)
        out = np.zeros((steps, 2), np.float32)
        for k, arc in enumerate(s_list):
            centre, heading = self.ego_route.at(arc)
            rear = centre - REAR_AXLE_OFFSET * np.array([math.cos(heading), math.sin(heading)])
            dx, dy = rear[0] - x, rear[1] - y
            out[k] = (c * dx + s * dy, -s * dx + c * dy)
        return out

    def _rollout(self, s: float, speed: float, count: int, horizon: float, sees=None) -> list:
        """(arc length of the expert's box centre, speed) after each of `count` steps, predicting `horizon` s;
        `sees` (track ids or None for everyone) are the road users it reacts to."""
        agents = self.agents if sees is None else [a for a in self.agents if a.track_id in sees]
        shadow = replace(self.ego, history=[], controlled=False)
        shadow.s = s
        stop = _junction_gap(shadow, [a for a in agents if a.kind != "pedestrian"])
        stop_s = s + stop if math.isfinite(stop) else math.inf
        others = self._ahead_of_ego(agents)
        future = self._predicted_positions(others, horizon)
        near = self._near_route(future, s, s + speed * horizon + 50.0)
        out = []
        for k in range(count):
            shadow.s = s
            first = min(int(k * self.dt / PREDICTION_STEP_S), len(future) - 1)
            times, agents = np.nonzero(near[first:])  # where anyone will be from now to the horizon is in the way
            gap, leader_speed = _leader(shadow, [others[a] for a in agents], future[first + times, agents])
            if stop_s - s < gap:
                gap, leader_speed = max(stop_s - s, 0.1), 0.0
            accel = float(np.clip(_idm(speed, _curve_speed(shadow), gap, leader_speed), -7.0, 2.5))
            new_speed = max(speed + accel * self.dt, 0.0)
            s = min(s + (speed + new_speed) / 2 * self.dt, self.ego_route.length)
            speed = new_speed
            out.append((s, speed))
        return out

    def _near_route(self, future: np.ndarray, start_s: float, end_s: float) -> np.ndarray:
        """(J, A) True where a predicted position lies within 2 m of the ego route between two arc lengths:
        only those can enter the IDM corridor (route points, 1.6 m reach at most), so only those are searched."""
        low, high = int(max(start_s, 0.0) / POINT_SPACING), int(min(end_s, self.ego_route.length) / POINT_SPACING) + 1
        segment = self.ego_route.points[low:high:2]  # every 0.5 m: 2 m of margin covers the spacing
        if not len(segment) or not future.size:
            return np.zeros(future.shape[:2], bool)
        flat = future.reshape(-1, 2)
        distance = np.sqrt(((flat[:, None, :] - segment[None, :, :]) ** 2).sum(-1)).min(axis=1)
        return (distance < 2.0).reshape(future.shape[:2])

    def _ahead_of_ego(self, agents: list) -> list:
        """Those of `agents` that can get in the expert's way: all but those behind it going its way (its followers)."""
        x, y, yaw = self.ego.history[-1][:3]
        forward = np.array([math.cos(yaw), math.sin(yaw)])
        keep = []
        for agent in agents:
            behind = float(np.dot(np.array(agent.history[-1][:2]) - (x, y), forward)) < 0.0
            if not (behind and math.cos(agent.history[-1][2] - yaw) > 0.5):
                keep.append(agent)
        return keep

    @staticmethod
    def _predicted_positions(agents: list, horizon: float) -> np.ndarray:
        """(J, A, 2) positions every PREDICTION_STEP_S up to `horizon`: each agent along its own route at its
        current acceleration (to a standstill at most): privileged, the expert knows where everyone is headed,
        not what a script will do next."""
        times = np.arange(0.0, horizon + PREDICTION_STEP_S, PREDICTION_STEP_S)
        out = np.zeros((len(times), len(agents), 2))
        for j, agent in enumerate(agents):
            if agent.parked:
                out[:, j] = agent.history[-1][:2]
                continue
            speed, accel = agent.history[-1][3], float(np.clip(agent.history[-1][4], -8.0, 2.5))
            moving = np.minimum(times, speed / -accel) if accel < 0 else times
            arc = agent.s + speed * moving + 0.5 * accel * moving ** 2
            position = np.clip(arc / POINT_SPACING, 0.0, len(agent.route.points) - 1.001)  # as Route.at
            index = position.astype(int)
            frac = (position - index)[:, None]
            out[:, j] = agent.route.points[index] * (1 - frac) + agent.route.points[index + 1] * frac
        return out

    def _expert_reach(self, duration_s: float) -> float:
        """Arc length the expert reaches in `duration_s`, replanning every step and tracking its plan exactly.

        Run on a copy with the same scripts. Where the expert stops (a braked lead car, a pedestrian), that is
        what the route asks of any policy; a real tracker's lag only costs a closed-loop expert a little."""
        shared = {id(self.town): self.town, **{id(a.route): a.route for a in [self.ego] + self.agents}}
        expert = copy.deepcopy(self, shared)  # town and routes are never mutated: shared, not copied
        horizon = 6 * PREDICTION_STEP_S
        for _ in range(int(round(duration_s / self.dt))):
            s, speed = expert._rollout(expert.ego.s, expert.ego.speed, 1, horizon)[0]
            expert.step()
            centre, heading = self.ego_route.at(s)
            expert.ego.s, expert.ego.speed = s, speed
            expert.ego.history[-1] = (float(centre[0]), float(centre[1]), heading, speed, 0.0)
        return max(float(expert.ego.s), self.ego.s + 1.0)

def place_background(routes: _Routes, ego: Agent, count: int, rng: np.random.Generator, radius: float,
                     class_mix: dict, placed: list, first_id: int, keep_clear=None) -> list:
    """Random road users like a recorded scene's, within `radius` of the ego, clear of `placed` agents.

    `keep_clear(agent) -> bool` rejects spawns that would spoil a scenario (e.g. a car between the ego and
    the scenario's actor). Returns the new agents, track ids from `first_id`."""
    ego_xy, _ = ego.route.at(ego.s)
    kinds, weights = list(class_mix), np.array(list(class_mix.values()), dtype=float)
    added: list = []
    for track_id in range(first_id, first_id + count):
        kind = str(rng.choice(kinds, p=weights / weights.sum()))
        for _ in range(60):
            agent = _spawn(kind, routes, rng, track_id)
            xy, _ = agent.route.at(agent.s)
            if (np.linalg.norm(xy - ego_xy) < radius and _clear_of(agent, placed + added + [ego])
                    and (keep_clear is None or keep_clear(agent))):
                added.append(agent)
                break
    return added
