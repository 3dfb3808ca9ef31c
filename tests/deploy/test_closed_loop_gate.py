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


def export(pipeline, state_dict, path):
    from stack.deploy.calibration import Calibration
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network

    network = export_network(pipeline, state_dict, Calibration.from_rig(pipeline.data.rig))
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


def test_an_int8_model_that_drives_like_fp32_passes(models):
    from stack.deploy.gates.closed_loop import closed_loop_gate

    pipeline, fp32, _ = models
    result = closed_loop_gate(pipeline, fp32, fp32, ClosedLoopBudget(episodes=4), latency_ms=50.0, log=lambda *_: None)
    assert result["passed"] and result["driving_score_drop"] == 0.0 and result["collision_rise"] == 0.0, result


def test_a_quantization_that_damages_the_planner_fails_the_gate(models):
    from stack.deploy.gates.closed_loop import closed_loop_gate, markdown

    pipeline, fp32, damaged = models
    result = closed_loop_gate(pipeline, damaged, fp32, ClosedLoopBudget(episodes=4), latency_ms=50.0,
                              log=lambda *_: None)
    assert not result["passed"], result
    assert result["driving_score_drop"] > 0.1 and result["int8_worse"], result
    assert any("closed loop: INT8" in reason for reason in result["reasons"])
    assert "FAIL" in "\n".join(markdown(result))


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
