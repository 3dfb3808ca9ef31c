"""Policies: what a bundle's gate.json gives the closed loop as latency, and what it refuses."""

import json

import pytest

from stack.deploy.network_policies import bundle_latency, checkpoint_spec
from stack.errors import StackError


def _bundle(tmp_path, gate) -> str:
    (tmp_path / "gate.json").write_text(gate if isinstance(gate, str) else json.dumps(gate))
    return str(tmp_path)


GATE = {"files": {}, "passed": True, "target": "orin", "runtime": "tensorrt"}


def test_a_tensorrt_bundle_drives_at_the_latency_its_gate_recorded(tmp_path):
    seconds, how = bundle_latency(_bundle(tmp_path, {**GATE, "fps": {"median_ms": 42.0, "mode": "predicted"}}))
    assert seconds == pytest.approx(0.042)
    assert "predicted for orin" in how


def test_an_onnx_runtime_bundle_is_measured_here(tmp_path):
    assert bundle_latency(_bundle(tmp_path, {**GATE, "runtime": "onnxruntime"})) is None


@pytest.mark.parametrize("gate, says", [
    ("{not json", "found invalid JSON"),
    ([1, 2], "found a JSON array"),
    ({**GATE, "fps": "fast"}, "no median latency"),
    ({**GATE, "fps": {"median_ms": "12"}}, "no median latency"),
])
def test_a_gate_json_without_the_gates_fields_is_a_clear_error(tmp_path, gate, says):
    with pytest.raises(StackError, match=says):
        bundle_latency(_bundle(tmp_path, gate))


def test_a_network_without_a_finite_plan_stops_the_car_instead_of_ending_the_evaluation(tmp_path):
    import torch

    from stack.checkpoint.model_file import save_model_checkpoint

    from stack.metrics.driving import score_episode
    from stack.models import build_model
    from tests.sim.test_drive import drive_once, episode, micro_pipeline

    pipeline = micro_pipeline("drive.episode_seconds=3.0")
    weights = {name: torch.full_like(value, float("nan")) if name.startswith("planning_head.") and
               value.is_floating_point() else value for name, value in build_model(pipeline).state_dict().items()}
    diverged = save_model_checkpoint(tmp_path / "diverged.pt", pipeline, weights)
    run = drive_once(pipeline, checkpoint_spec("diverged", str(diverged)), episode("route", 0, 0, 3.0))
    assert run.trace.ego[0, 3] > 5.0 and run.trace.ego[-1, 3] < 1.0, "the car must brake to a stop"
    assert score_episode(run.trace, 25.0)["ego_progress"] < 0.5
