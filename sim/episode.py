"""One closed-loop episode: the policy plans from what the world shows it, the plan reaches the controller
after the policy's latency, the kinematic bicycle follows it, and the other road users react.

The loop, at the simulation rate (`drive.sim_hz`):

    every sim_hz / replan_hz steps: observe (render the cameras if the policy uses them), plan, stamp the
        plan in world coordinates with the times of its waypoints, and queue it for time t + latency
    step the ego's bicycle through the step, switching to each queued plan at the instant it arrives
        (the tracker turns the active plan into acceleration and steering for each piece of the step)
    place the ego in the world, step every other road user; record the step
    end the episode at an at-fault collision, when blocked, or off the route (`stack.sim.infractions`)

A slow network therefore drives on stale plans, as it would on the car: its plan from time t is
followed from exactly t + latency on, its first waypoints already in the past. The ego's vehicle model
steps finer than the world where a plan arrives inside a simulation step (a 30 ms policy drives 30 ms on
its previous plan, then on the new one), so a 1.5 ms and a 43 ms policy drive differently, as on the car;
the other road users see the ego at the simulation rate. Until the first plan arrives the ego keeps its
speed and heading. Everything is seeded by the episode's spec, so the same policy, latency and spec replay
the same episode step for step (clips are replays).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from stack.kinematics import WAYPOINT_STEP_S
from stack.sim.infractions import RouteMonitor
from stack.sim.policies import Observation, Policy
from stack.sim.vehicle import PlanTracker, VehicleLimits, VehicleState, step_bicycle


@dataclass
class EpisodeRun:
    """What one episode leaves: the metrics' trace, and (when recorded) the frames of its clip."""

    trace: object
    """stack.metrics.driving.EpisodeTrace."""
    replans: int
    frames: list = field(default_factory=list)
    """Per step, when recorded: the dicts `stack.sim.drive_clips.write_clip` draws."""
    timings: dict = field(default_factory=dict)
    """Seconds spent in render / policy / simulation (the bench reads them)."""
    end: dict | None = None
    """The infraction that ended the episode early (`stack.sim.infractions`: kind, time_s, x, y, what, actor),
    None when it ran its time."""


def _plan_to_world(plan_ego: np.ndarray, pose: tuple) -> np.ndarray:
    """Ego-frame rear-axle waypoints -> world xy, for the pose (x_rear, y_rear, yaw) they were planned at."""
    x, y, yaw = pose
    c, s = math.cos(yaw), math.sin(yaw)
    return np.stack([x + c * plan_ego[:, 0] - s * plan_ego[:, 1], y + s * plan_ego[:, 0] + c * plan_ego[:, 1]], axis=1)


def _hold_plan(state, now: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep speed and heading: the plan the ego follows before any policy plan has arrived."""
    t = WAYPOINT_STEP_S * np.arange(1, steps + 1)
    distance = state.speed * t
    xy = np.stack([state.x + distance * math.cos(state.yaw), state.y + distance * math.sin(state.yaw)], axis=1)
    return xy, now + t


def _route_steer(world, limits) -> float:
    """The steering angle that holds the route's curvature where the ego starts (a car already in a bend is
    steering; its yaw rate is part of the ego status the blind rollout extrapolates)."""
    from stack.sim.world.roads import POINT_SPACING

    route = world.ego_route
    index = min(max(int(world.ego.s / POINT_SPACING), 0), len(route.curvature) - 1)
    return float(np.clip(math.atan(limits.wheelbase * route.curvature[index]), -limits.max_steer, limits.max_steer))


def _footprint(x: float, y: float, yaw: float, length: float, width: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    corners = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]], np.float64) * [length / 2, width / 2]
    return corners @ np.array([[c, s], [-s, c]]) + [x, y]


class Recorder:
    """Collects the trace, step by step, in the layout `stack.metrics.driving.EpisodeTrace` reads."""

    def __init__(self, world, ego_size: tuple, rear_offset: float):
        self.world, self.ego_size, self.rear_offset = world, ego_size, rear_offset
        self.ego, self.agents, self.progress, self.on_drivable = [], [], [], []
        first = world.agents_now()
        self.agent_sizes = np.asarray(first["boxes"], np.float64)[:, 3:5].reshape(-1, 2)
        self.agent_classes = list(first["classes"])
        self.agent_static = np.asarray(first["static"], bool).reshape(-1)
        self.start_progress = world.route_progress()

    def record(self, state) -> None:
        cx = state.x + self.rear_offset * math.cos(state.yaw)
        cy = state.y + self.rear_offset * math.sin(state.yaw)
        self.ego.append((cx, cy, state.yaw, state.speed, state.accel))
        agents = self.world.agents_now()
        boxes = np.asarray(agents["boxes"], np.float64).reshape(-1, 5)
        self.agents.append(np.concatenate([boxes[:, :3], np.asarray(agents["speed"], np.float64).reshape(-1, 1)], axis=1))
        self.progress.append(self.world.route_progress() - self.start_progress)
        corners = _footprint(cx, cy, state.yaw, *self.ego_size)
        self.on_drivable.append(bool(np.all(self.world.on_drivable(corners))))

    def trace(self, dt: float, ended: str = ""):
        from stack.metrics.driving import EpisodeTrace

        return EpisodeTrace(ended=ended, 
            dt=dt, ego=np.array(self.ego, np.float64), ego_size=tuple(self.ego_size),
            agents=np.stack(self.agents).reshape(len(self.agents), -1, 4), agent_sizes=self.agent_sizes,
            agent_classes=self.agent_classes, agent_static=self.agent_static,
            progress=np.array(self.progress, np.float64),
            route_length=float(self.world.goal_s - self.start_progress), on_drivable=np.array(self.on_drivable))


def run_episode(world, policy: Policy, drive, rig, limits=None, record_clip: bool = False,
                clip_rig=None, observer=None) -> EpisodeRun:
    """Drive one episode of `world` with `policy` under `drive` (stack.pipeline.DriveConfig) and return its run.

    `record_clip` also renders `clip_rig` (the front camera) every step and keeps what the clip draws.
    `observer(world, ego_status)`, when given, is called at every replanning instant before the policy plans,
    with the world in the state the policy sees: the hook that records the states a policy visits, labelled by
    the expert (`stack.sim.recording`); its time is the timings' "labelling"."""
    import time

    from stack.sim.world.scene import EGO_SIZE, REAR_AXLE_OFFSET

    limits = limits or VehicleLimits()
    dt = 1.0 / drive.sim_hz
    if abs(world.dt - dt) > 1e-9:
        from stack.errors import StackError

        raise StackError(f"the world steps every {world.dt:g} s but drive.sim_hz={drive.sim_hz:g} asks for {dt:g} s: "
                         f"build it with build_world(spec, world_config, 1 / drive.sim_hz)")
    steps = int(round(drive.episode_seconds * drive.sim_hz))
    replan_every = int(round(drive.sim_hz / drive.replan_hz))
    latency = float(policy.spec.latency_s)
    x, y, yaw, speed, accel = world.ego_state()
    state = VehicleState(x, y, yaw, speed, accel, _route_steer(world, limits))
    tracker = PlanTracker(limits, dt=dt)
    recorder = Recorder(world, EGO_SIZE[:2], REAR_AXLE_OFFSET)
    recorder.record(state)
    monitor = RouteMonitor(world, drive, EGO_SIZE[:2], REAR_AXLE_OFFSET)
    end = None
    pending: deque = deque()
    active = _hold_plan(state, 0.0, policy.steps)
    timings = {"render": 0.0, "policy": 0.0, "simulation": 0.0, "labelling": 0.0}
    frames, replans = [], 0
    for k in range(steps):
        now = k * dt
        world.set_ego(state.x, state.y, state.yaw, state.speed, state.accel)  # the ego where it is at step k
        if k % replan_every == 0:
            start = time.perf_counter()
            images = world.render(rig)["images"] if policy.uses_cameras else None
            timings["render"] += time.perf_counter() - start
            status = np.array([state.speed, state.accel, state.speed * math.tan(state.steer) / limits.wheelbase],
                              np.float32)
            if observer is not None:
                start = time.perf_counter()
                observer(world, status)
                timings["labelling"] += time.perf_counter() - start
            start = time.perf_counter()
            plan = policy.plan(Observation(now, status, world.command(), images, world))
            timings["policy"] += time.perf_counter() - start
            pending.append((now + latency, _plan_to_world(plan, (state.x, state.y, state.yaw)),
                            now + WAYPOINT_STEP_S * np.arange(1, len(plan) + 1)))
            replans += 1
        active = _arrived(pending, now, active)
        if record_clip:
            frames.append(_clip_frame(world, state, active[0], clip_rig, now, policy.spec.name, REAR_AXLE_OFFSET))
        start = time.perf_counter()
        state, active = _drive_step(state, tracker, pending, active, now, dt, limits)
        world.step()  # everyone else moves from k to k + 1, seeing the ego at step k
        world.set_ego(state.x, state.y, state.yaw, state.speed, state.accel)
        recorder.record(state)
        end = monitor.check(state, now + dt)
        timings["simulation"] += time.perf_counter() - start
        if end is not None:
            break
    return EpisodeRun(recorder.trace(dt, end["kind"] if end else ""), replans, frames, timings, end)


ARRIVAL_TOLERANCE_S = 1e-9
"""Plans that arrive within this of an instant count as arrived then (k * dt sums are not exact)."""


def _arrived(pending: deque, now: float, active: tuple) -> tuple:
    """The newest plan that has arrived by `now` (popping it and any older ones), else `active`."""
    while pending and pending[0][0] <= now + ARRIVAL_TOLERANCE_S:
        _, xy, times = pending.popleft()
        active = (xy, times)
    return active


def _drive_step(state, tracker, pending: deque, active: tuple, now: float, dt: float, limits) -> tuple:
    """The ego's state after one simulation step, switching plans at their exact arrival times inside it.

    The step is cut at every arrival; each piece holds the tracker's command for the plan active then
    (`PlanTracker.command`'s `dt`), and the bicycle is exact for constant commands over any piece."""
    t, end = now, now + dt
    while end - t > ARRIVAL_TOLERANCE_S:
        active = _arrived(pending, t, active)
        until = min(end, pending[0][0]) if pending else end
        piece = until - t if until - t > ARRIVAL_TOLERANCE_S else end - t
        accel_cmd, steer_cmd = tracker.command(state, active[0], active[1], t, dt=piece)
        state = step_bicycle(state, accel_cmd, steer_cmd, piece, limits)
        t += piece
    return state, active


def _clip_frame(world, state, plan_xy, clip_rig, now: float, name: str, rear_offset: float) -> dict:
    from stack.sim.world.scene import EGO_SIZE

    agents = world.agents_now()
    front = world.render(clip_rig)["images"][0] if clip_rig is not None else None
    centre = (state.x + rear_offset * math.cos(state.yaw), state.y + rear_offset * math.sin(state.yaw), state.yaw)
    return {"time_s": now, "front": front, "ego": centre, "ego_size": tuple(EGO_SIZE[:2]),
            "agents": np.asarray(agents["boxes"], np.float64), "classes": list(agents["classes"]),
            "plan": np.asarray(plan_xy), "route": np.asarray(world.ego_route.points), "title": name}
