"""Scene setup (town, ground raster, agent placement, traffic) after its speed-ups: the same worlds as recorded.

The reference (`tests/assets/worlds/scene_setup.npz`) holds the worlds the generator made before its setup was
made faster (per-block k-d tree queries, a distance matrix and lists per agent and step, rng.choice): it was
written by the current code on the AVX-512 machine where that code reproduced, bit for bit, the old generator's
sha256 of these outputs (efc81c67...). A digest cannot hold across CPUs: numpy's SIMD kernels
for sin, cos, arctan2 and exp differ per instruction set in the last bits (an AVX2-only EPYC got another
digest). So what is structural -- the ground raster, counts, kinds, ids, flags, key frames and how many draws
each scene took from its generator -- must match exactly, and every float within `TOLERANCE`.
"""

import numpy as np
import pytest

from stack.sim.world.roads import SIDEWALK_OUTER, _blocks_near, make_arms
from stack.sim.world.scene import simulate
from stack.sim.world.traffic import _leader, _leaders, step

SCENES = (((0, 0), 40, 40.0, {"car": 0.3, "truck": 0.2, "pedestrian": 0.3, "cyclist": 0.2}),
          ((0, 1), 40, 40.0, {"car": 0.3, "truck": 0.2, "pedestrian": 0.3, "cyclist": 0.2}),
          ((7, 2), 24, 70.0, None))
"""(seed, agents, spawn radius, class mix) of the three recorded scenes (6 key frames at 2 Hz)."""
TOLERANCE = 1e-9
"""Largest difference allowed in a float (metres, radians, 1/m, light factors). Seen between numpy's AVX-512 and
its AVX2 or SSE4.2 kernels: 2e-14 after 6 s of traffic; a change to the generator moves values by far more."""
ROUTE_STRIDE = 16
"""Routes (~1,700 points, 0.25 m apart) and road arms are stored every 16th point, to keep the reference small; their
lengths are compared in full, and the agents' histories, which follow the routes, are stored whole."""


def scene_setup_outputs() -> dict[str, np.ndarray]:
    """Towns (arms, ground raster, paint, buildings, trees), routes, every agent's history and attributes, the key
    frames, the scene look, and the state each scene leaves its random generator in, as named arrays."""
    found = {}
    for index, (seed, agents, radius, mix) in enumerate(SCENES):
        rng = np.random.default_rng(seed)
        scene = simulate(rng, 6, 2.0, agents, radius, mix)
        town, everyone, name = scene.town, [scene.ego] + scene.agents, f"scene{index}/"
        found[name + "arm_lengths"] = np.array([len(arm) for arm in town.arms])
        found[name + "arms"] = np.concatenate([arm[::ROUTE_STRIDE] for arm in town.arms])
        found[name + "ground_classes"], found[name + "ground_yellow"] = town.ground.classes, town.ground.yellow
        found[name + "ground_origin"] = np.array(town.ground.origin, np.float64)
        found[name + "buildings"], found[name + "trees"] = town.buildings, town.trees
        found[name + "kinds"] = np.array([agent.kind for agent in everyone])
        found[name + "sizes"] = np.array([agent.size for agent in everyone], np.float64)
        found[name + "junctions"] = np.array([agent.route.junction for agent in everyone], np.float64)
        found[name + "colour_track_parked_turn_arm"] = np.array(
            [(a.colour, a.track_id, a.parked, a.route.turn, a.route.entry_arm) for a in everyone], np.int64)
        found[name + "route_lengths"] = np.array([len(agent.route.points) for agent in everyone])
        for field in ("points", "headings", "curvature"):
            found[name + "route_" + field] = np.concatenate([getattr(a.route, field)[::ROUTE_STRIDE] for a in everyone])
        found[name + "history_lengths"] = np.array([len(agent.history) for agent in everyone])
        found[name + "histories"] = np.concatenate([np.asarray(agent.history, np.float64) for agent in everyone])
        found[name + "key_steps"], found[name + "light"] = scene.key_steps.astype(np.int64), scene.light
        state = rng.bit_generator.state["state"]
        found[name + "rng_state"] = np.array([str(state["state"]), str(state["inc"])])
    return found


def test_scene_setup_makes_the_recorded_worlds_on_any_cpu(arrays_reference):
    arrays_reference(scene_setup_outputs(), "worlds/scene_setup.npz", atol=TOLERANCE)


@pytest.mark.parametrize("seed", range(6))
def test_grouped_block_test_finds_exactly_the_blocks_a_query_of_every_block_finds(seed):
    from scipy.spatial import cKDTree

    points = np.concatenate(make_arms(np.random.default_rng([seed, 5])))
    tree, low = cKDTree(points), points.min(axis=0) - 30.0
    block, reach = 1.0, SIDEWALK_OUTER + 2.5
    high = points.max(axis=0) + 30.0
    shape = (int(np.ceil((high[1] - low[1]) / block)), int(np.ceil((high[0] - low[0]) / block)))
    rows, cols = np.indices(shape).reshape(2, -1)
    every = np.isfinite(tree.query(np.stack([low[0] + (cols + 0.5) * block, low[1] + (rows + 0.5) * block], 1),
                                   distance_upper_bound=reach)[0]).reshape(shape)
    grouped = _blocks_near(tree, low, block, shape, reach)
    assert every.any() and not every.all()
    np.testing.assert_array_equal(grouped, every)


def _per_agent_leaders(agents):
    """The leader search as `step` did it before it was batched: `_leader` over a list per agent."""
    positions = np.array([a.history[-1][:2] for a in agents])
    vehicles = [a for a in agents if a.kind != "pedestrian"]
    found = []
    for index, agent in enumerate(agents):
        if agent.parked or agent.controlled or agent.forced_accel is not None:
            continue
        if agent.kind == "pedestrian":
            found.append(_leader(agent, vehicles, np.array([v.history[-1][:2] for v in vehicles]).reshape(-1, 2)))
        else:
            others = [o for k, o in enumerate(agents) if k != index]
            found.append(_leader(agent, others, np.delete(positions, index, axis=0)))
    return found


def test_batched_leader_search_finds_what_the_per_agent_search_finds():
    scene = simulate(np.random.default_rng([3, 4]), 2, 2.0, 40, 35.0)
    everyone = [scene.ego] + scene.agents
    everyone[3].controlled, everyone[5].forced_accel = True, -3.0
    compared = leaders_seen = 0
    for _ in range(30):
        rows = [k for k, a in enumerate(everyone) if not (a.parked or a.controlled or a.forced_accel is not None)]
        batched = _leaders(everyone, [everyone[k] for k in rows], rows, np.array([a.history[-1][:2] for a in everyone]))
        expected = _per_agent_leaders(everyone)
        assert batched == expected
        compared += len(batched)
        leaders_seen += sum(np.isfinite(gap) for gap, _ in batched)
        step(everyone)
    assert compared > 500 and leaders_seen > 50, (compared, leaders_seen)  # the scene has traffic to follow
