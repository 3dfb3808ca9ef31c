"""The simulator does not flatter: a crash, a blocked car or one that leaves its route ends the drive, and a
plan takes effect exactly when it arrives, not at the next whole simulation step (stack.sim.infractions,
stack.sim.episode)."""

import numpy as np
import pytest

from stack.config import load_pipeline
from stack.metrics.driving import score_episode
from stack.sim.policies import Policy, PolicySpec
from stack.sim.scenarios import episode_specs
from tests.sim.test_drive import FILES, drive_once, episode, micro_pipeline


class StandStill(Policy):
    """Plans to stay where it is (every waypoint at the rear axle): a car that never drives on."""

    def plan(self, observation):
        return np.zeros((self.steps, 2))


class SwerveLeft(Policy):
    """Plans a hard left arc off its route, whatever the road does."""

    def plan(self, observation):
        t = 0.5 * np.arange(1, self.steps + 1)
        speed, curvature = max(float(observation.ego_status[0]), 5.0), 0.15
        heading = speed * t * curvature
        return np.stack([np.sin(heading) / curvature, (1 - np.cos(heading)) / curvature], axis=1)


@pytest.fixture(scope="module")
def pipeline():
    return micro_pipeline()


def test_an_at_fault_collision_ends_the_drive_and_its_route_completion(pipeline):
    """Blind constant velocity drives into the stopped car: the episode ends at the contact, the event names
    the car, and route completion is what was driven before it (it no longer drives through and on)."""
    ended = []
    for index in range(3):
        run = drive_once(pipeline, PolicySpec("constant_velocity", "constant_velocity"),
                         episode("stopped_vehicle", index, index))
        if run.end is None:
            continue
        ended.append(run)
        assert run.end["kind"] == "collision" and run.trace.ended == "collision"
        assert "collision" in run.end["what"] and "actor" in run.end
        assert len(run.trace.ego) < int(round(pipeline.drive.episode_seconds * pipeline.drive.sim_hz)) + 1
        score = score_episode(run.trace, 40.0, pipeline.drive.episode_seconds)
        assert score["ended_collision"] == 1.0 and score["collisions"] >= 1 and score["no_collision"] == 0.0
        assert score["driven_s"] == pytest.approx(run.end["time_s"])
    assert len(ended) >= 2, "constant velocity must crash into the stopped car in most stopped_vehicle episodes"


def test_the_expert_is_never_ended_early_on_any_evaluation_episode():
    """Every episode `stack drive` scores (the tiny recipe's 56, eight seconds each): the expert is the
    reference the blocked rule asks, so a rule that ends one of its drives would end good policies too."""
    pipeline = load_pipeline(FILES, [])
    drive = pipeline.drive
    for spec in episode_specs(drive.scenarios, drive.episodes, drive.seeds, drive.episode_seconds):
        run = drive_once(pipeline, PolicySpec("expert", "expert"), spec)
        assert run.end is None, f"{spec}: the expert's drive ended early: {run.end}"


def test_a_car_that_never_drives_on_is_blocked(pipeline):
    run = drive_once(pipeline, PolicySpec("stand still", "custom", builder=StandStill), episode("route", 0, 0))
    assert run.end is not None and run.end["kind"] == "blocked", run.end
    blocked = pipeline.drive.blocked_seconds
    assert blocked <= run.end["time_s"] < pipeline.drive.episode_seconds
    window = int(round(blocked / run.trace.dt))
    assert np.all(run.trace.ego[-window:, 3] < 0.5), "blocked: standing for the whole window"
    score = score_episode(run.trace, 40.0, pipeline.drive.episode_seconds)
    assert score["ended_blocked"] == 1.0 and score["route_completion"] < 0.3


def test_a_car_that_leaves_its_route_is_stopped_there(pipeline):
    run = drive_once(pipeline, PolicySpec("swerve", "custom", builder=SwerveLeft), episode("route", 1, 0))
    assert run.end is not None and run.end["kind"] == "route_deviation", run.end
    assert f"drive.route_deviation_m={pipeline.drive.route_deviation_m:g}" in run.end["what"]
    assert score_episode(run.trace, 40.0, pipeline.drive.episode_seconds)["ended_route_deviation"] == 1.0
    strict = micro_pipeline("drive.route_deviation_m=2.5")
    early = drive_once(strict, PolicySpec("swerve", "custom", builder=SwerveLeft), episode("route", 1, 0))
    assert early.end["kind"] == "route_deviation" and early.end["time_s"] <= run.end["time_s"]


def _gap_to_lead(pipeline, spec, trace) -> float:
    from stack.sim.scenarios import build_world

    world = build_world(spec, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
    lead = list(world.agents_now()["track_ids"]).index(world.scripts[0].agent)
    return float(np.min(np.linalg.norm(trace.agents[:, lead, :2] - trace.ego[:, :2], axis=1)))


def test_latency_takes_effect_exactly_not_at_the_next_whole_step():
    """1.5 ms and 150 ms policies drive differently on the braking scenario, and the slower one comes closer to
    the car that brakes; a 1.5 ms policy is not delayed by a whole 100 ms step (it drives almost as a 0 ms one)."""
    pipeline = micro_pipeline("drive.replan_hz=10")
    spec = episode("lead_brake", 0, 0)
    runs = {ms: drive_once(pipeline, PolicySpec("expert", "expert", latency_s=ms / 1000.0, latency_how="given"),
                           spec).trace for ms in (0.0, 1.5, 100.0, 150.0)}
    assert not np.array_equal(runs[1.5].ego, runs[150.0].ego)
    assert not np.array_equal(runs[1.5].ego, runs[100.0].ego), "1.5 ms must not be rounded up to a 100 ms step"
    assert not np.array_equal(runs[100.0].ego, runs[150.0].ego), "150 ms must not be rounded up to 200 ms or down"
    assert _gap_to_lead(pipeline, spec, runs[150.0]) < _gap_to_lead(pipeline, spec, runs[1.5])
    near = np.abs(runs[1.5].ego[:, :2] - runs[0.0].ego[:, :2]).max()
    far = np.abs(runs[100.0].ego[:, :2] - runs[0.0].ego[:, :2]).max()
    assert near < 0.25 * far, (near, far)
