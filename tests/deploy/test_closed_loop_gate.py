"""The closed-loop gate of `stack deploy`: an INT8 model that drives like fp32 passes; one whose planner
quantization damaged fails, and on a `best` target fp32 ships instead.

The models are micro BevNets (128x64 images, untrained: the planner is its kinematic prior). The damaged
one has the planner's output layer shifted the way a bad quantization scale shifts it: a constant
lateral residual per waypoint, so its plans drift left by up to 2.4 m over 3 s.
"""

import pytest
import torch

from stack.pipeline import ClosedLoopBudget
from tests.sim.test_drive import micro_pipeline


def export(pipeline, state_dict, path, calibration=None):
    from stack.deploy.calibration import Calibration
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network

    network = export_network(pipeline, state_dict, calibration or Calibration.from_rig(pipeline.data.rig))
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from stack.models import build_model

    pipeline = micro_pipeline("drive.scenarios=[lead_brake,route]", "drive.seeds=[0]")
    torch.manual_seed(0)
    state = build_model(pipeline).state_dict()
    folder = tmp_path_factory.mktemp("gate")
    damaged = dict(state)
    bias = torch.zeros_like(state["planning_head.waypoints.bias"]).view(-1, 2)
    bias[:, 1] = 0.4  # metres to the left per 0.5 s step, accumulated by the head's cumsum
    damaged["planning_head.waypoints.bias"] = bias.view(-1)
    return pipeline, export(pipeline, state, folder / "model.onnx"), export(pipeline, damaged, folder / "damaged.onnx")


def one_vehicle(pipeline):
    """The nominal rig as one car's cameras are really mounted: 25 cm further forward, 8 cm higher, pitched 3
    degrees down (about each camera's x axis), focal lengths 4% longer, principal points 3 px off-centre."""
    import math

    import numpy as np

    from stack.deploy.calibration import Calibration

    nominal = Calibration.from_rig(pipeline.data.rig)
    angle = math.radians(3.0)
    pitch = np.array([[1, 0, 0], [0, math.cos(angle), -math.sin(angle)], [0, math.sin(angle), math.cos(angle)]])
    poses = nominal.cam_to_ego.copy()
    poses[:, :3, :3] = poses[:, :3, :3] @ pitch
    poses[:, :3, 3] += [0.25, 0.0, 0.08]
    ks = nominal.intrinsics.copy()
    ks[:, 0, 0] *= 1.04
    ks[:, 1, 1] *= 1.04
    ks[:, :2, 2] += 3.0
    return Calibration(nominal.image_width, nominal.image_height, nominal.cameras, ks, poses, name="car 17")


def test_an_int8_model_that_drives_like_fp32_passes(models):
    from stack.deploy.gates.closed_loop import closed_loop_gate

    pipeline, fp32, _ = models
    result = closed_loop_gate(pipeline, fp32, fp32, ClosedLoopBudget(episodes=4), latency_ms=50.0, log=lambda *_: None)
    assert result["passed"] and result["driving_score_drop"] == 0.0 and result["collision_rise"] == 0.0, result
    surely = result["statistics"]["driving_score_drop"]
    assert surely["low"] == surely["high"] == 0.0 and surely["within_surely"] and surely["episodes"] == 4


def test_a_quantization_that_damages_the_planner_fails_the_gate(models):
    from stack.deploy.gates.closed_loop import closed_loop_gate, markdown

    pipeline, fp32, damaged = models
    result = closed_loop_gate(pipeline, damaged, fp32, ClosedLoopBudget(episodes=4), latency_ms=50.0,
                              log=lambda *_: None)
    assert not result["passed"], result
    assert result["driving_score_drop"] > 0.1 and result["int8_worse"], result
    assert any("closed loop: INT8" in reason for reason in result["reasons"])
    report = "\n".join(markdown(result))
    assert "FAIL" in report and "paired bootstrap over whole episodes" in report
    drop = result["statistics"]["driving_score_drop"]
    assert 0 < drop["low"] <= result["driving_score_drop"] <= drop["high"] and drop["episodes_needed"] >= 2, drop


def test_a_failed_closed_loop_gate_fails_int8_targets_and_ships_fp32_on_best_targets(models):
    from stack.deploy.orchestrate import DeploySpec, _choose_shipped, _closed_loop_step
    from stack.pipeline import Target

    pipeline, fp32, damaged = models
    failing = {"passed": False, "reasons": ["closed loop: INT8 driving score drops"]}
    spec = DeploySpec(None, {}, [], {}, [], [], None, [], "", closed_loop=lambda *args: dict(failing))
    for precision, fails in (("int8", True), ("best", False)):
        target = Target(precision=precision, closed_loop=ClosedLoopBudget(episodes=2))
        result = {"failures": [], "accuracy": {"passed": True}}
        _closed_loop_step(spec, damaged, fp32, target, result, log=lambda *_: None)
        assert bool(result["failures"]) is fails, (precision, result)
    timing = type("T", (), {"median_ms": 1.0})
    shipped = _choose_shipped(Target(precision="best"), damaged, fp32, result, {damaged.name: timing, fp32.name: timing})
    assert shipped["file"] == fp32.name and "drives worse" in shipped["why"]


def test_a_per_vehicle_bundle_is_driven_through_its_own_cameras_and_judged(models, tmp_path):
    """`stack deploy --calibration`: the bundle pools for one car's cameras, so the simulator renders those (the
    bundle's runtime refuses frames of any other calibration, so driving at all shows it); the drive is judged by
    the quality bar like any other, and a per-vehicle bundle that drives badly fails it."""
    from stack.deploy.gates.closed_loop import closed_loop_gate, markdown
    from stack.deploy.gates.quality import driving_quality
    from stack.models import build_model

    pipeline, _, _ = models
    car = one_vehicle(pipeline)
    torch.manual_seed(0)
    state = build_model(pipeline).state_dict()
    bias = torch.zeros_like(state["planning_head.waypoints.bias"]).view(-1, 2)
    bias[:, 1] = 0.4  # the planner that drifts left: it drives worse than the blind policies
    drifting = export(pipeline, dict(state, **{"planning_head.waypoints.bias": bias.view(-1)}),
                      tmp_path / "car17.onnx", car)
    lines = []
    result = closed_loop_gate(pipeline, None, drifting, ClosedLoopBudget(episodes=4), latency_ms=50.0, log=lines.append)
    assert result["cameras"] == {"calibration": "car 17", "hash": car.hash, "rendered": "the bundle's own calibration"}
    assert any("renders the bundle's calibration 'car 17'" in line for line in lines), lines
    assert result["fp32"]["episodes"] == 4 and "skipped" not in result
    assert "rendered the bundle's own calibration (calibration 'car 17'" in "\n".join(markdown(result))
    verdict = driving_quality(result)
    assert "not_judged" not in verdict and verdict["passed"] is False, verdict


def test_the_simulator_renders_a_measured_camera_where_it_is_mounted():
    """A CalibratedRig is rendered from its matrices: a 'front' camera calibrated with the front-left camera's K and
    mount sees what the nominal front-left camera sees (the same labels), and the nominal rig's matrices survive the trip."""
    import numpy as np

    from stack.deploy.calibration import Calibration
    from stack.rig import CalibratedRig, rig_matrices
    from stack.sim.scenarios import EpisodeSpec, build_world

    pipeline = micro_pipeline()
    rig = pipeline.data.rig
    ks, poses = rig_matrices(rig)
    for got, want in zip(rig_matrices(Calibration.from_rig(rig).as_rig()), (ks, poses)):
        assert np.allclose(got, want, atol=1e-12)
    left = [c.name for c in rig.cameras].index("front_left")
    measured = CalibratedRig.from_matrices(rig.image_width, rig.image_height, ["front"], ks[left:left + 1],
                                           poses[left:left + 1])
    world = build_world(EpisodeSpec("route", 0, 0, 1.0), pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
    nominal, seen = world.render_labelled(rig), world.render_labelled(measured)
    assert np.array_equal(seen["semantic"][0], nominal["semantic"][left])
    assert np.allclose(seen["depth"][0], nominal["depth"][left], atol=1e-3)
    assert not np.array_equal(nominal["semantic"][0], nominal["semantic"][left])
    pixels = np.abs(seen["images"][0].astype(int) - nominal["images"][left].astype(int))
    assert pixels.mean() < 4.0, "the same view up to the sensor noise, which is drawn per camera index"


def _int8_rows(drops: list, collisions_added: list) -> list:
    """Scored rows of fp32, INT8 and the other policies on the same episodes: INT8 loses `drops[i]` of driving
    score and adds `collisions_added[i]` at-fault collisions on episode i."""
    rows = []
    for i, (drop, added) in enumerate(zip(drops, collisions_added)):
        for policy, score, collisions in (("fp32", 0.8, 0.0), ("int8", 0.8 - drop, added), ("expert", 0.95, 0.0),
                                          ("constant_velocity", 0.5, 1.0), ("ego_rollout", 0.6, 1.0)):
            rows.append({"policy": policy, "family": "lead_brake", "seed": 0, "index": i,
                         "metrics": {"driving_score": score, "pdms": score, "collisions": collisions,
                                     "route_completion": 1.0}})
    return rows


DROVE = {"episodes": 8, "latency_ms": 50.0, "latency_how": "stand-in", "scenarios": ["lead_brake"], "seeds": [0],
         "episode_seconds": 8.0, "replan_hz": 2.0}


def test_a_drop_within_budget_on_the_mean_but_not_surely_is_inconclusive_and_fails():
    """One episode in eight wrecked by INT8: the mean drop (0.0625) is within the 0.08 budget, but the paired
    interval over episodes reaches past it, so the comparison is inconclusive and fails unless the target
    accepts it; `stack deploy --verify` reaches the same verdict from gate.json's figures; a drop that is
    surely small passes."""
    from stack.deploy.gates.closed_loop import gate_record, markdown
    from stack.deploy.verdicts import _closed_loop_passed

    rows = _int8_rows([0.5] + [0.0] * 7, [0.0] * 8)
    result = gate_record(rows, ClosedLoopBudget(episodes=8), True, DROVE)
    assert result["driving_score_drop"] == pytest.approx(0.0625) and result["statistics"]["driving_score_drop"]["high"] > 0.1
    assert not result["passed"] and result["inconclusive"] == ["driving_score_drop"], result
    assert "inconclusive" in result["reasons"][0] and "closed_loop.inconclusive_passes" in result["reasons"][0]
    assert any("inconclusive" in line for line in markdown(result))
    assert _closed_loop_passed(result) is False
    accepted = gate_record(rows, ClosedLoopBudget(episodes=8, inconclusive_passes=True), True, DROVE)
    assert accepted["passed"] and accepted["inconclusive"] == ["driving_score_drop"] and _closed_loop_passed(accepted)
    surely = gate_record(_int8_rows([0.02] * 8, [0.0] * 8), ClosedLoopBudget(episodes=8), True, DROVE)
    assert surely["passed"] and surely["inconclusive"] == [] and _closed_loop_passed(surely)
    forged = {**result, "inconclusive": []}  # a record that hides its inconclusive comparison
    assert _closed_loop_passed({**forged, "budget": {**forged["budget"], "inconclusive_passes": False}}) is False


def test_a_collision_rise_beyond_budget_fails_whatever_its_interval():
    """Two extra at-fault collisions in eight episodes (0.25 per episode) fail the 0.11 budget on the mean."""
    from stack.deploy.gates.closed_loop import gate_record

    result = gate_record(_int8_rows([0.0] * 8, [1.0, 1.0] + [0.0] * 6), ClosedLoopBudget(episodes=8), True, DROVE)
    assert not result["passed"] and result["collision_rise"] == pytest.approx(0.25)
    assert "at-fault collisions" in result["reasons"][0] and result["inconclusive"] == []


def test_int8_within_the_drop_budget_that_no_longer_beats_a_blind_policy_fails():
    """What ships must clear the bar the network cleared: fp32 beats the ego rollout on every episode by 0.05,
    INT8 loses 0.04 (within the 0.08 budget, surely) and with it the lead (a gain of 0.01 with one episode in
    four a loss: the interval reaches below 0). The gate fails, names the comparison, ships fp32 on `best`
    targets, and `stack deploy --verify` reaches the same verdict from the episode scores."""
    from stack.deploy.gates.closed_loop import gate_record
    from stack.deploy.verdicts import _closed_loop_passed

    rows = []
    for i in range(16):
        lost = 0.04 + (0.08 if i % 4 == 0 else -0.0266)
        for policy, score in (("fp32", 0.65), ("int8", 0.65 - lost), ("expert", 0.95), ("constant_velocity", 0.3),
                              ("ego_rollout", 0.6)):
            rows.append({"policy": policy, "family": "lead_brake", "seed": 0, "index": i,
                         "metrics": {"driving_score": score, "pdms": score, "collisions": 0.0,
                                     "route_completion": 1.0}})
    result = gate_record(rows, ClosedLoopBudget(episodes=16), True, {**DROVE, "episodes": 16})
    assert result["driving_score_drop"] <= 0.08 and result["inconclusive"] == [], result
    assert result["int8_bar"]["passed"] is False and not result["passed"], result
    assert any("INT8 does not clear the bar fp32 clears" in reason and "ego_rollout in driving_score" in reason
               for reason in result["reasons"]), result["reasons"]
    assert _closed_loop_passed(result) is False
    forged = {**result, "passed": True, "reasons": [], "int8_bar": {"passed": True, "comparisons": []}}
    assert _closed_loop_passed(forged) is False, "verify decides the bar from the episode scores, not the record"
    fine = gate_record(_int8_rows([0.0] * 8, [0.0] * 8), ClosedLoopBudget(episodes=8), True, DROVE)
    assert fine["passed"] and fine["int8_bar"]["passed"] and _closed_loop_passed(fine)
