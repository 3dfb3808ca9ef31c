"""The interactive world: an externally driven ego that the traffic sees, scripts, the expert, rendering."""

import math
import pickle

import numpy as np
import pytest

from stack.sim.world.interactive import InteractiveWorld, Script
from stack.sim.world.roads import LANE_WIDTH, make_town
from stack.sim.world.scene import REAR_AXLE_OFFSET, _Routes, simulate
from stack.sim.world.traffic import SIM_DT, SIZES, Agent, _make_route, step, vehicle_route

RECORDED_TOLERANCE = 1e-9
"""Largest difference allowed in a recorded history value (m, rad, m/s): numpy's SIMD kernels differ per CPU in
the last bits (2e-14 seen between AVX-512 and AVX2 or SSE4.2 dispatch), any change to the traffic far more."""


def test_recorded_scenes_are_unchanged_by_the_interactive_additions(arrays_reference):
    """Every agent's history in two recorded scenes as before the closed loop touched `traffic.step`.

    The reference (`tests/assets/worlds/recorded_histories.npz`) was written on the AVX-512 machine where the
    code reproduced, bit for bit, the sha256 of these histories taken before the interactive additions
    (a737962c...); agent and step counts must match exactly, values within `RECORDED_TOLERANCE`."""
    found = {}
    for seed in (0, 3):
        scene = simulate(np.random.default_rng([seed, 1]), 4, 2.0, 24)
        everyone = [scene.ego] + scene.agents
        found[f"seed{seed}/history_lengths"] = np.array([len(agent.history) for agent in everyone])
        found[f"seed{seed}/histories"] = np.concatenate([np.asarray(agent.history, np.float64) for agent in everyone])
    arrays_reference(found, "worlds/recorded_histories.npz", atol=RECORDED_TOLERANCE)


def _town(seed=3):
    town = make_town(np.random.default_rng([seed, 99]))
    return town, _Routes(town)


def _straight_route(town):
    """An inbound lane route (entry arm 0, straight or turning: only its first 25 m before the junction matter)."""
    for exit_ in range(1, len(town.arms)):
        route = vehicle_route(town, 0, exit_)
        if route.turn == 1:
            return route
    return vehicle_route(town, 0, 1)


def _world(town, route, ego_s, ego_speed, agents, scripts=(), dt=SIM_DT):
    return InteractiveWorld(town, route, ego_s, ego_speed, 9.0, agents, np.array([0.5, 0.6, 1.0, 1.0, 1.0]),
                            (0, 1, 2, 3, 4), scripts, duration_s=2.0, dt=dt)


def _hold_ego(world):
    world.set_ego(*world.ego_state()[:3], 0.0, 0.0)


def test_step_leaves_a_controlled_agent_where_its_driver_put_it():
    town, routes = _town()
    route = _straight_route(town)
    ego = Agent("car", route, 150.0, 8.0, 8.0, (4.6, 1.9, 1.6), 0, 0, controlled=True)
    ego.history.append((*route.at(150.0)[0], route.at(150.0)[1], 8.0, 0.0))
    step([ego])
    assert len(ego.history) == 1 and ego.s == 150.0


def test_a_car_behind_the_ego_brakes_when_the_ego_stops_and_not_otherwise():
    town, _ = _town()
    route = _straight_route(town)
    entry = route.junction[0]

    def follower_after(ego_stops: bool):
        follower = Agent("car", route, entry - 60.0, 8.0, 9.0, SIZES["car"], 0, 1)
        world = _world(town, route, entry - 40.0, 0.0, [follower])
        for _ in range(60):
            if ego_stops:
                _hold_ego(world)
            else:  # the ego is somewhere else entirely
                world.set_ego(0.0, 500.0, 0.0, 0.0, 0.0)
            world.step()
        return follower

    stopped_for = follower_after(True)
    assert stopped_for.speed < 0.5
    gap = (entry - 40.0) - stopped_for.s - (4.6 + SIZES["car"][0]) / 2
    assert 0.5 < gap < 6.0, gap
    assert follower_after(False).s > entry - 10.0


def test_a_pedestrian_about_to_cross_waits_for_an_ego_standing_on_the_crossing():
    town, _ = _town()
    route = _straight_route(town)
    centre, heading = route.at(route.junction[0] - 40.0)
    right = np.array([math.sin(heading), -math.cos(heading)])
    crossing = _make_route(np.stack([centre + right * 6.0, centre - right * (LANE_WIDTH + 5.0)]))

    def pedestrian_after(ego_on_crossing: bool):
        walker = Agent("pedestrian", crossing, 0.0, 1.4, 1.4, SIZES["pedestrian"], 0, 1)
        world = _world(town, route, route.junction[0] - 40.0, 0.0, [walker])
        for _ in range(60):
            if ego_on_crossing:
                _hold_ego(world)
            else:
                world.set_ego(0.0, 500.0, 0.0, 0.0, 0.0)
            world.step()
        return walker

    waiting = pedestrian_after(True)
    assert waiting.speed == 0.0 and waiting.s < 6.0 - 0.95 - 0.3, waiting.s  # stopped before the ego's side
    assert pedestrian_after(False).s > 8.0  # walked through the lane (6 m to its centre)


def test_scripts_fire_on_time_and_on_the_egos_distance_and_override_the_rules():
    town, _ = _town()
    route = _straight_route(town)
    entry = route.junction[0]
    lead = Agent("car", route, entry - 60.0, 8.0, 8.0, SIZES["car"], 0, 1)
    centre, heading = route.at(entry - 30.0)
    right = np.array([math.sin(heading), -math.cos(heading)])
    walker = Agent("pedestrian", _make_route(np.stack([centre + right * 5.0, centre - right * 8.0])),
                   0.0, 0.0, 1.5, SIZES["pedestrian"], 0, 2)
    scripts = (Script(1, after="brake", after_s=1.0, decel=6.0),
               Script(2, before="hold", after="walk", ego_within_m=20.0, speed=1.5))
    world = _world(town, route, entry - 80.0, 8.0, [lead, walker], scripts)
    speeds, x, y, yaw, _, _ = [], *world.ego_state()
    for k in range(40):
        world.set_ego(x + 2.0 * k * SIM_DT * math.cos(yaw), y + 2.0 * k * SIM_DT * math.sin(yaw), yaw, 2.0, 0.0)
        world.step()
        speeds.append(lead.speed)
    assert world.fired_at(1) == 10 and speeds[9] > 7.5
    assert speeds[14] == pytest.approx(speeds[9] - 5 * 0.6, abs=1e-6) and speeds[-1] == 0.0
    assert world.fired_at(2) is None and walker.s == 0.0  # the ego (at 2 m/s) is still > 20 m away
    world2 = _world(town, route, entry - 45.0, 8.0, [Agent("pedestrian", walker.route, 0.0, 0.0, 1.5,
                                                           SIZES["pedestrian"], 0, 2)], scripts[1:])
    for _ in range(20):
        _hold_ego(world2)
        world2.step()
    assert world2.fired_at(2) is not None and world2.agents[0].s > 2.0


def test_same_inputs_same_world_and_it_survives_pickling():
    town, routes = _town()
    route = _straight_route(town)
    rng = np.random.default_rng(5)
    agents = [Agent("car", routes.random(rng), rng.uniform(0, 150), 6.0, 9.0, SIZES["car"], 0, k) for k in range(1, 15)]
    world = _world(town, route, route.junction[0] - 50.0, 8.0, agents)
    clone = pickle.loads(pickle.dumps(world))
    for w in (world, clone):
        x, y, yaw, _, _ = w.ego_state()
        for k in range(30):
            w.set_ego(x + 0.7 * k * math.cos(yaw), y + 0.7 * k * math.sin(yaw), yaw, 7.0, 0.0)
            w.step()
    assert np.array_equal(world.agents_now()["boxes"], clone.agents_now()["boxes"])
    assert world.step_index == 30 and world.time_s == pytest.approx(3.0)


def test_the_sim_step_is_configurable():
    town, _ = _town()
    route = _straight_route(town)
    lead = Agent("car", route, route.junction[0] - 60.0, 8.0, 8.0, SIZES["car"], 0, 1)
    world = _world(town, route, route.junction[0] - 100.0, 0.0, [lead], dt=0.05)
    for _ in range(20):
        _hold_ego(world)
        world.step()
    assert world.time_s == pytest.approx(1.0) and lead.s == pytest.approx(route.junction[0] - 52.0, abs=0.2)


def test_expert_stops_behind_a_stopped_car_and_follows_a_turn():
    town, _ = _town()
    route = _straight_route(town)
    ego_s = route.junction[0] - 60.0
    stopped = Agent("car", route, ego_s + 25.0, 0.0, 9.0, SIZES["car"], 0, 1)
    world = _world(town, route, ego_s, 9.0, [stopped], (Script(1, before="hold"),))
    plan = world.expert_plan(6, 0.5)
    assert plan.shape == (6, 2) and np.all(np.diff(plan[:, 0]) >= -1e-3)
    rear_limit = 25.0 - (4.6 + SIZES["car"][0]) / 2 + REAR_AXLE_OFFSET
    steps = np.diff(np.concatenate([[0.0], plan[:, 0]]))
    assert plan[-1, 0] < rear_limit - 1.0 and np.all(np.diff(steps[1:]) < 0) and steps[-1] < steps[1] / 2  # braking
    free = _world(town, route, ego_s, 9.0, []).expert_plan(6, 0.5)
    assert free[-1, 0] > 24.0  # without the car it keeps its speed
    for exit_ in range(1, len(town.arms)):
        turn = vehicle_route(town, 0, exit_)
        if turn.turn != 1:
            plan = _world(town, turn, turn.junction[0] - 8.0, 8.0, []).expert_plan(6, 0.5)
            assert abs(plan[-1, 1]) > 2.0 and np.sign(plan[-1, 1]) == (1 if turn.turn == 0 else -1)
            break


def test_agents_now_and_drivable_ground():
    town, _ = _town()
    route = _straight_route(town)
    parked = Agent("car", route, 20.0, 0.0, 0.0, SIZES["car"], 0, 7, parked=True)
    world = _world(town, route, 100.0, 5.0, [parked])
    now = world.agents_now()
    assert now["boxes"].shape == (1, 5) and now["static"].tolist() == [True] and now["track_ids"].tolist() == [7]
    centre, heading = route.at(100.0)
    off_road = centre + 30.0 * np.array([math.sin(heading), -math.cos(heading)])
    assert world.on_drivable(np.stack([centre, off_road])).tolist() == [True, False]
    assert world.route_progress() == pytest.approx(100.0)


def test_render_gives_images_of_the_rig_deterministically():
    from stack.pipeline import RigConfig

    town, _ = _town()
    route = _straight_route(town)
    rig = RigConfig(image_width=64, image_height=32)
    rig.cameras = rig.cameras[:2]
    world = _world(town, route, 120.0, 5.0, [Agent("car", route, 135.0, 0.0, 0.0, SIZES["car"], 0, 1, parked=True)])
    first, again = world.render(rig), pickle.loads(pickle.dumps(world)).render(rig)
    assert set(first) == {"images", "intrinsics", "cam_to_ego"}
    assert first["images"].shape == (2, 32, 64, 3) and first["images"].dtype == np.uint8
    assert np.array_equal(first["images"], again["images"])


def test_expert_brakes_for_a_pedestrian_stepping_out_and_ignores_the_car_behind_it():
    town, _ = _town()
    route = _straight_route(town)
    ego_s = route.junction[0] - 60.0
    centre, heading = route.at(ego_s + 18.0)
    right = np.array([math.sin(heading), -math.cos(heading)])
    path = _make_route(np.stack([centre + right * 4.0, centre - right * 8.0]))
    walking = Agent("pedestrian", path, 0.5, 1.8, 1.8, SIZES["pedestrian"], 0, 1)
    free = _world(town, route, ego_s, 9.0, []).expert_plan()
    braking = _world(town, route, ego_s, 9.0, [walking], (Script(1, before="walk", speed=1.8),)).expert_plan()
    assert braking[-1, 0] < 18.0 - 2.3 + REAR_AXLE_OFFSET < free[-1, 0]  # stops short instead of slipping past
    follower = Agent("car", route, ego_s - 7.0, 12.0, 12.0, SIZES["car"], 0, 2)
    followed = _world(town, route, ego_s, 9.0, [follower]).expert_plan()
    assert np.allclose(followed, free)


def test_goal_is_where_the_expert_gets_to():
    town, _ = _town()
    route = _straight_route(town)
    ego_s = route.junction[0] - 80.0
    stopped = Agent("car", route, ego_s + 30.0, 0.0, 9.0, SIZES["car"], 0, 1)
    blocked = InteractiveWorld(town, route, ego_s, 9.0, 9.0, [stopped], np.ones(5), (0,), (Script(1, before="hold"),),
                               duration_s=8.0)
    open_road = InteractiveWorld(town, route, ego_s, 9.0, 9.0, [], np.ones(5), (0,), (), duration_s=8.0)
    assert ego_s + 20.0 < blocked.goal_s < ego_s + 30.0 - (4.6 + SIZES["car"][0]) / 2
    assert open_road.goal_s > ego_s + 60.0


def test_a_script_with_an_unknown_behaviour_is_refused_when_written():
    with pytest.raises(ValueError, match="expected one of rules, hold, brake, walk"):
        Script(1, after="swerve")
