"""Scene setup (town, ground raster, agent placement, traffic) after its speed-ups: the same worlds, bit for bit."""

import hashlib

import numpy as np
import pytest

from stack.sim.world.roads import SIDEWALK_OUTER, _blocks_near, make_arms
from stack.sim.world.scene import simulate
from stack.sim.world.traffic import _leader, _leaders, step

RECORDED_SETUP = "efc81c67edf9acb3a5b999f3ac26ef79c78e47cc87ed003d61870fb5bcd08f25"
"""sha256 of everything `simulate` returns for three scenes, recorded with the generator before its setup was
made faster (per-block k-d tree queries, a distance matrix and lists per agent and step, rng.choice)."""


def setup_fingerprint() -> str:
    """Digest of towns (arms, ground raster, paint, buildings, trees), routes, every agent's history, the
    key frames, the scene look, and where each scene leaves its random generator."""
    digest = hashlib.sha256()
    for seed, agents, radius, mix in (((0, 0), 40, 40.0, {"car": 0.3, "truck": 0.2, "pedestrian": 0.3, "cyclist": 0.2}),
                                      ((0, 1), 40, 40.0, {"car": 0.3, "truck": 0.2, "pedestrian": 0.3, "cyclist": 0.2}),
                                      ((7, 2), 24, 70.0, None)):
        rng = np.random.default_rng(seed)
        scene = simulate(rng, 6, 2.0, agents, radius, mix)
        town = scene.town
        for array in [*town.arms, town.ground.classes, town.ground.yellow, town.buildings, town.trees]:
            digest.update(np.ascontiguousarray(array).tobytes())
        digest.update(repr(town.ground.origin).encode())
        for agent in [scene.ego] + scene.agents:
            route = agent.route
            digest.update(repr((agent.kind, agent.size, agent.colour, agent.track_id, agent.parked, route.junction,
                                route.turn, route.entry_arm)).encode())
            for array in (route.points, route.headings, route.curvature, np.asarray(agent.history, np.float64)):
                digest.update(array.tobytes())
        digest.update(scene.key_steps.astype(np.int64).tobytes() + scene.light.tobytes())
        digest.update(repr(rng.bit_generator.state["state"]).encode())
    return digest.hexdigest()


def test_scene_setup_makes_the_recorded_worlds_bit_for_bit():
    assert setup_fingerprint() == RECORDED_SETUP


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
