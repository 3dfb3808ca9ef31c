"""Closed-loop states labelled by the privileged expert: the data that teaches a network to recover.

Behaviour cloning on the expert's own drives sees only the states the expert visits; a student that errs
drifts into states it never saw, and its errors compound (Ross & Bagnell, AISTATS 2010). Our simulator can
render any ego pose and the expert (`InteractiveWorld.expert_plan`) can label any state, so two remedies
share this module:

- **Perturbed demonstrations** (DART, Laskey et al., CoRL 2017; ChauffeurNet's perturbations, Bansal et
  al. 2018): the expert drives with noise injected into its plans (`NoisyExpertPolicy`: for a second or
  two it drifts sideways, or drives too fast or too slow), so the recorded states leave its path, while
  every label is the clean expert plan from the state reached: the recovery.
- **DAgger** (Ross, Gordon & Bagnell, AISTATS 2011): the student drives (mixed with the expert per replan
  with probability beta, `MixturePolicy`) and the expert labels the states the student visits.

`record_episode` drives one episode of a scenario family at a *training* seed with any driver and returns
each replanning instant's frame: everything a recorded key frame carries (cameras, depth, semantic and
instance maps, boxes) with the ego's status, command, past and, as the planning target, the expert's plan
from there. `stack.data.make` writes them into shards beside the recorded scenes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from stack.kinematics import WAYPOINT_STEP_S
from stack.sim.policies import ExpertPolicy, Observation, Policy, PolicySpec
from stack.sim.scenarios import EpisodeSpec, build_world, episode_specs
from stack.sim.world.scene import REAR_AXLE_OFFSET
from stack.sim.world.traffic import PAST_SECONDS

NOISE_WORD = 0xD1A7
"""Seed word of a driver's noise, after the episode's own words: the noise replays with the episode."""


@dataclass(frozen=True)
class Perturbation:
    """How `NoisyExpertPolicy` departs from the expert (DART's injected noise, ChauffeurNet's perturbations).

    At each replanning instant without a perturbation, one starts with probability `rate`; it lasts
    `seconds` and either drifts the plan sideways by up to `lateral_m` (reached over 1.5 s, the way a
    distracted driver leaves the lane centre) or scales its speed by a factor in `speed`."""

    rate: float = 0.35
    seconds: tuple = (1.0, 2.0)
    lateral_m: tuple = (0.6, 1.8)
    speed: tuple = (0.55, 1.35)


class EpisodeRandom:
    """A generator seeded by the episode's world (its seed words, NOISE_WORD, `extra`) and restarted when a new
    episode begins, so a driver's noise replays with the episode whatever ran before it in the process."""

    def __init__(self, *extra: int):
        self.extra, self.words, self.generator = extra, None, None

    def get(self, observation: Observation) -> tuple:
        """(generator, whether it was just restarted)."""
        words = tuple(observation.world.seed_words)
        restarted = self.words != words or observation.time_s == 0.0
        if restarted:
            self.words, self.generator = words, np.random.default_rng([*words, NOISE_WORD, *self.extra])
        return self.generator, restarted


def camera_sight(frame: dict) -> frozenset:
    """Track ids of the road users a rendered frame shows: at least one visible pixel in some camera, the rule
    by which a box becomes a detection label (`stack.data.samples.label_fields`)."""
    return frozenset(int(track) for track in frame["box_ids"][frame["visibility"] > 0, 1])


def expert_sight(world, pipeline):
    """The `sees` argument of `InteractiveWorld.expert_plan` under `data.world.expert_sees`: None (everyone),
    or whom the cameras have shown so far (`LabelledFrames` records it before the driver plans)."""
    if pipeline is None or pipeline.data.world.expert_sees == "everyone":
        return None
    sight = getattr(world, "camera_sight", None)
    if sight is None:
        raise RuntimeError("data.world.expert_sees=cameras needs the frame of this instant rendered first: "
                           "drive with a LabelledFrames observer (stack.sim.recording.record_episode)")
    return sight


class NoisyExpertPolicy(Policy):
    """The expert's plan, perturbed for a second or two at random moments; the noise is seeded by the episode.
    Under `data.world.expert_sees=cameras` the expert it perturbs reacts only to what the cameras show."""

    perturbation = Perturbation()

    def __init__(self, spec: PolicySpec, steps: int, pipeline=None):
        super().__init__(spec, steps, pipeline)
        self.pipeline = pipeline
        self._random, self._until, self._shape = EpisodeRandom(), -1.0, (0.0, 1.0)

    def plan(self, observation: Observation) -> np.ndarray:
        sees = expert_sight(observation.world, self.pipeline)
        expert = np.asarray(observation.world.expert_plan(self.steps, WAYPOINT_STEP_S, sees), np.float64)
        rng, restarted = self._random.get(observation)
        if restarted or observation.time_s >= self._until:
            self._until, self._shape = -1.0, (0.0, 1.0)
            if rng.random() < self.perturbation.rate:
                self._until = observation.time_s + rng.uniform(*self.perturbation.seconds)
                if rng.random() < 0.5:
                    self._shape = (rng.choice((-1.0, 1.0)) * rng.uniform(*self.perturbation.lateral_m), 1.0)
                else:
                    self._shape = (0.0, rng.uniform(*self.perturbation.speed))
        lateral, speed = self._shape
        t = WAYPOINT_STEP_S * np.arange(1, self.steps + 1)
        return np.stack([expert[:, 0] * speed, expert[:, 1] + lateral * np.minimum(t / 1.5, 1.0)], axis=1)


class MixturePolicy(Policy):
    """DAgger's driver: at each replan, the expert's plan with probability `beta`, else the student's.

    `student` is a built Policy; `beta` = 1 is the expert, 0 the student alone (Ross et al. 2011 decay beta
    over iterations)."""

    def __init__(self, student: Policy, beta: float):
        super().__init__(PolicySpec(f"{student.spec.name} (beta {beta:g})", "mixture",
                                    latency_s=student.spec.latency_s, latency_how=student.spec.latency_how),
                         student.steps)
        self.student, self.beta, self.expert = student, float(beta), ExpertPolicy(student.spec, student.steps)
        self.uses_cameras = student.uses_cameras
        self._random = EpisodeRandom(1)

    def plan(self, observation: Observation) -> np.ndarray:
        if self._random.get(observation)[0].random() < self.beta:
            return self.expert.plan(observation)
        return self.student.plan(observation)


class LabelledFrames:
    """The episode observer that renders every replanning instant with its labels (`run_episode`'s hook).

    The planning target is the expert's plan from the state the driver reached; the ego status is the one
    the driver's policy is given (speed, acceleration, the steering's yaw rate). With `cameras_only`, that
    expert reacts only to the road users the cameras have shown in this episode so far (`camera_sight` of
    every frame rendered; once seen, remembered, as a driver remembers the pedestrian who stepped behind a
    parked car), kept on the world as `camera_sight` for a driver that plans after it (`run_episode` calls
    observers first)."""

    def __init__(self, rig, steps: int, device="cpu", cameras_only: bool = False):
        self.rig, self.steps, self.device, self.cameras_only = rig, steps, device, cameras_only
        self.frames: list = []

    def __call__(self, world, ego_status: np.ndarray) -> None:
        frame = dict(world.render_labelled(self.rig, self.device))
        world.camera_sight = (world.camera_sight or frozenset()) | camera_sight(frame)
        sees = world.camera_sight if self.cameras_only else None
        frame["boxes"] = np.concatenate([frame["boxes"], frame["visibility"][:, None]], axis=1)
        frame["ego"] = np.asarray(ego_status, np.float32)
        frame["command"] = np.array([world.command()], np.int64)
        frame["past"] = past_positions(world)
        frame["future"] = np.asarray(world.expert_plan(self.steps, WAYPOINT_STEP_S, sees), np.float32)
        frame["time_s"] = world.time_s
        self.frames.append(frame)


def past_positions(world) -> np.ndarray:
    """(PAST_SECONDS / WAYPOINT_STEP_S, 2) past rear-axle positions in the current ego frame, oldest first.

    Before the episode began the ego drove at its starting speed and heading (its first pose, extended
    backwards), as a car already cruising does."""
    history, dt = world.ego.history, world.dt
    stride = int(round(WAYPOINT_STEP_S / dt))
    now = len(history) - 1
    x0, y0, yaw0, speed0, _ = history[0]
    points = []
    for k in range(int(PAST_SECONDS / WAYPOINT_STEP_S), 0, -1):
        step = now - stride * k
        if step >= 0:
            x, y, yaw = history[step][:3]
        else:
            back = -step * dt * speed0
            x, y, yaw = x0 - back * math.cos(yaw0), y0 - back * math.sin(yaw0), yaw0
        points.append((x - REAR_AXLE_OFFSET * math.cos(yaw), y - REAR_AXLE_OFFSET * math.sin(yaw)))
    rx, ry, ryaw = world.ego_state()[:3]
    c, s = math.cos(ryaw), math.sin(ryaw)
    offsets = np.array(points, np.float64) - (rx, ry)
    return np.stack([offsets[:, 0] * c + offsets[:, 1] * s, -offsets[:, 0] * s + offsets[:, 1] * c],
                    axis=1).astype(np.float32)


def training_specs(families, episodes: int, duration_s: float) -> list:
    """`episodes` training episodes over the families (seed 0): their worlds never match an evaluation
    episode's nor a recorded scene's (`stack.sim.scenarios.rng_words`)."""
    return episode_specs(families, episodes, [0], duration_s, split="training")


def record_episode(spec: EpisodeSpec, driver: Policy, pipeline, device="cpu"):
    """(labelled frames, EpisodeRun) of one episode of `spec` driven by `driver` under `pipeline.drive`."""
    from stack.sim.episode import run_episode

    drive = dataclasses.replace(pipeline.drive, episode_seconds=spec.duration_s)
    world = build_world(spec, pipeline.data.world, 1.0 / drive.sim_hz)
    frames = LabelledFrames(pipeline.data.rig, pipeline.model.planning_steps, device,
                            cameras_only=pipeline.data.world.expert_sees == "cameras")
    run = run_episode(world, driver, drive, pipeline.data.rig, observer=frames)
    return frames.frames, run
