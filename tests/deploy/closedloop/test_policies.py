"""Policies: what a bundle's gate.json gives the closed loop as latency, and what it refuses."""

import json

import pytest

from stack.deploy.closedloop.policies import bundle_latency
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
    ("{not json", "not valid JSON"),
    ([1, 2], "lists no file checksums"),
    ({**GATE, "fps": "fast"}, "no median latency"),
    ({**GATE, "fps": {"median_ms": "12"}}, "no median latency"),
])
def test_a_gate_json_without_the_gates_fields_is_a_clear_error(tmp_path, gate, says):
    with pytest.raises(StackError, match=says):
        bundle_latency(_bundle(tmp_path, gate))
