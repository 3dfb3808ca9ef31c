"""Scenario families: seeded, held out from training, and each one a trap for a policy blind to the cameras."""

import math
import pickle

import numpy as np
import pytest

from stack.sim.world.scene import EGO_SIZE, REAR_AXLE_OFFSET
from stack.sim.scenarios import FAMILIES, EpisodeSpec, build_world, episode_specs, rng_words
from stack.errors import StackError
from stack.pipeline import DRIVE_SCENARIOS, WorldConfig

WORLD = WorldConfig(agents_per_scene=12)


def _overlap(a, b) -> bool:
    """Separating-axis test of two boxes (x, y, yaw, length, width)."""
    def corners(x, y, yaw, length, width):
        c, s = math.cos(yaw), math.sin(yaw)
        return np.array([[x + c * dx - s * dy, y + s * dx + c * dy]
                         for dx in (-length / 2, length / 2) for dy in (-width / 2, width / 2)])
    first, second = corners(*a), corners(*b)
    for yaw in (a[2], a[2] + math.pi / 2, b[2], b[2] + math.pi / 2):
        axis = np.array([math.cos(yaw), math.sin(yaw)])
        p, q = first @ axis, second @ axis
        if p.max() < q.min() or q.max() < p.min():
            return False
    return True


def _place_on_route(world, s):
    centre, heading = world.ego_route.at(s)
    world.set_ego(centre[0] - REAR_AXLE_OFFSET * math.cos(heading), centre[1] - REAR_AXLE_OFFSET * math.sin(heading),
                  heading, world.ego.speed, 0.0)


def _blind_drive(world, seconds=8.0):
    """The constant-velocity ego along its route; the class of the first road user its box overlaps, or None."""
    speed, start = world.ego.speed, world.ego.s
    for k in range(int(round(seconds / world.dt))):
        _place_on_route(world, start + speed * k * world.dt)
        ego_box = (*world.ego.history[-1][:3], *EGO_SIZE[:2])
        now = world.agents_now()
        for box, kind in zip(now["boxes"], now["classes"]):
            if _overlap(ego_box, tuple(box)):
                return kind
        world.step()
    return None


def test_families_are_the_pipelines_and_specs_cycle_families_then_seeds():
    assert FAMILIES == DRIVE_SCENARIOS
    specs = episode_specs(["lead_brake", "jaywalker"], 5, [7, 8], 6.0)
    assert [(s.family, s.seed, s.index) for s in specs] == [
        ("lead_brake", 7, 0), ("jaywalker", 7, 1), ("lead_brake", 8, 2), ("jaywalker", 8, 3), ("lead_brake", 7, 4)]
    assert all(s.duration_s == 6.0 for s in specs)
    with pytest.raises(StackError, match="choose from|among"):
        episode_specs(["lead_brakes"], 3, [0])
    with pytest.raises(StackError, match="route, lead_brake"):
        build_world(EpisodeSpec("zigzag", 0, 0), WORLD)


def test_scenario_worlds_never_reuse_a_training_scenes_generator():
    training = {(WORLD.seed, scene) for scene in range(1000)} | {(WORLD.seed, scene, 1) for scene in range(1000)}
    for spec in episode_specs(FAMILIES, 70, [0, 1, 2]):
        assert tuple(rng_words(spec, WORLD)) not in training and len(rng_words(spec, WORLD)) == 5


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_builds_for_several_seeds_and_indices(family):
    for index, seed in ((0, 0), (3, 1), (11, 2)):
        world = build_world(EpisodeSpec(family, index, seed), WORLD)
        assert world.ego_route.length - world.ego.s > 8.0 * 10.0  # room for the whole episode at ~10 m/s
        assert world.ego.s < world.goal_s <= world.ego_route.length
        assert world.agents_now()["boxes"].shape[1] == 5 and world.step_index == 0
        if family != "route":
            assert any(a.track_id == 1 for a in world.agents)  # the scenario's actor
        if family == "unprotected_turn":
            oncoming = [a for a in world.agents if a.track_id in (1, 2)]
            assert world.ego_route.turn == 0 and all(a.route.turn == 1 and a.speed > 7.0 for a in oncoming)


def test_same_spec_same_world_after_the_same_ego_inputs_even_in_another_process():
    spec = EpisodeSpec("zebra_crossing", 4, 1)
    worlds = [build_world(spec, WORLD), pickle.loads(pickle.dumps(build_world(spec, WORLD)))]
    for world in worlds:
        for k in range(30):
            _place_on_route(world, world.start_s + 6.0 * k * world.dt)
            world.step()
    first, second = (w.agents_now() for w in worlds)
    assert np.array_equal(first["boxes"], second["boxes"]) and np.array_equal(first["speed"], second["speed"])
    other = build_world(EpisodeSpec("zebra_crossing", 4, 2), WORLD)
    assert not np.array_equal(other.ego_route.points[:5], worlds[0].ego_route.points[:5])


def test_the_lead_car_brakes_hard_to_a_stop():
    world = build_world(EpisodeSpec("lead_brake", 0, 5), WORLD)
    lead = next(a for a in world.agents if a.track_id == 1)
    speeds = []
    for k in range(50):
        _place_on_route(world, world.start_s + 3.0 * k * world.dt)  # a slow ego stays well behind
        world.step()
        speeds.append(lead.speed)
    fired = world.fired_at(1)
    assert fired is not None and 10 <= fired <= 30
    decel = -np.diff(speeds)[fired:fired + 5] / world.dt
    assert np.all(decel > 5.0) and speeds[-1] == 0.0


@pytest.mark.parametrize("family", ["zebra_crossing", "jaywalker"])
def test_the_pedestrian_walks_into_the_egos_lane_whatever_the_egos_speed(family):
    for ego_speed in (4.0, 9.0):
        world = build_world(EpisodeSpec(family, 2, 0), WORLD)
        walker = next(a for a in world.agents if a.track_id == 1)
        lateral = []
        for k in range(120):
            _place_on_route(world, world.start_s + ego_speed * k * world.dt)
            world.step()
            to_route = np.linalg.norm(world.ego_route.points - walker.history[-1][:2], axis=1)
            lateral.append(float(to_route.min()))
        assert world.fired_at(1) is not None, ego_speed
        assert min(lateral) < 0.5, (ego_speed, min(lateral))  # on the ego's lane centre at some point


@pytest.mark.parametrize("family", ["lead_brake", "stopped_vehicle", "zebra_crossing", "jaywalker"])
def test_a_constant_velocity_ego_runs_into_the_scenarios_road_user(family):
    hits = [_blind_drive(build_world(EpisodeSpec(family, index, 7), WORLD)) for index in range(4)]
    assert sum(kind is not None for kind in hits) >= 3, hits


def test_the_egos_presence_changes_the_others_behaviour():
    """The cut-in car waits for the ego to come near; a car behind a stopped ego stops."""
    world = build_world(EpisodeSpec("cut_in", 1, 0), WORLD)
    car = next(a for a in world.agents if a.track_id == 1)
    for _ in range(40):
        world.set_ego(*world.ego_state()[:3], 0.0, 0.0)  # the ego stands far back
        world.step()
    assert world.fired_at(1) is None and car.speed == 0.0
    driven = build_world(EpisodeSpec("cut_in", 1, 0), WORLD)
    assert _blind_drive(driven, 6.0) is not None and driven.fired_at(1) is not None


def test_the_simulation_step_follows_the_drive_rate_and_the_scenario_does_not():
    coarse, fine = (build_world(EpisodeSpec("lead_brake", 2, 0), WORLD, dt) for dt in (0.1, 0.05))
    assert fine.dt == 0.05 and fine.ego_route is not coarse.ego_route
    assert np.allclose(fine.ego_route.points, coarse.ego_route.points) and fine.scripts == coarse.scripts
    for world in (coarse, fine):
        while world.time_s < 6.0 - 1e-9:
            world.set_ego(*world.ego_state()[:3], 0.0, 0.0)
            world.step()
    leads = [next(a for a in w.agents if a.track_id == 1) for w in (coarse, fine)]
    assert leads[0].speed == leads[1].speed == 0.0 and abs(leads[0].s - leads[1].s) < 1.0
    assert coarse.fired_at(1) * 2 == pytest.approx(fine.fired_at(1), abs=1)


def test_no_episode_starts_with_a_collision_the_ego_cannot_brake_for():
    """In a crowded town (the tiny preset's mix) the expert's first plan never needs hard braking."""
    crowded = WorldConfig(agents_per_scene=40, spawn_radius_m=40.0,
                          class_mix={"car": 0.3, "truck": 0.2, "pedestrian": 0.3, "cyclist": 0.2})
    for index in range(8):
        world = build_world(EpisodeSpec("route", index, index % 3), crowded)
        first = world.expert_plan()[0, 0]
        accel = 2 * (first - world.ego.speed * 0.5) / 0.5 ** 2
        assert accel > -3.0, (index, accel)


@pytest.mark.parametrize("family", ["zebra_crossing", "jaywalker"])
def test_a_crossing_pedestrian_leaves_a_driver_who_looks_time_to_stop(family):
    """From the pedestrian's first step to the blind ego's impact: at least 1 s to react plus braking at 4 m/s^2."""
    for index in range(6):
        world = build_world(EpisodeSpec(family, index, 3), WORLD)
        speed = world.ego.speed
        assert _blind_drive(world) == "pedestrian"
        warning = world.time_s - world.fired_at(1) * world.dt
        assert warning >= 1.0 + speed / 8.0, (index, warning, speed)
