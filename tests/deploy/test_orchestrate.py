"""The deploy bundle on the stand-in network: files, report wording, and the FPS gate's verdicts."""

import dataclasses
import json
import sys

import numpy as np
import pytest

from stack.config import load_pipeline, load_target
from stack.deploy.accuracy import HeadBudget, session_runner
from stack.deploy.orchestrate import DeploySpec, run_deploy

from deploy_fixture_net import example_inputs, make_net, make_samples


def _spec(net):
    feeds = make_samples(12, seed=3)

    def evaluate(run):  # relative error of the segmentation logits against the PyTorch network
        import torch

        errors = []
        for sample in feeds[8:]:
            with torch.no_grad():
                expected = net(**{k: torch.from_numpy(v) for k, v in sample.items()})["segmentation"].numpy()
            errors.append(float(np.linalg.norm(run(sample)["segmentation"] - expected) / np.linalg.norm(expected)))
        return {"seg_rel_error": float(np.mean(errors))}

    return DeploySpec(net, example_inputs(), ["segmentation", "speed"], {"pipeline_hash": "test"}, feeds[:8],
                      feeds[8:], evaluate, [HeadBudget("segmentation", "seg_rel_error", 0.05, False)],
                      "fixture samples", "fixture.pt", "fixture", "test")


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(["configs/pipeline.yaml"], ["export.calibration_samples=8", "export.timing_runs=30",
                                                     "export.keep_fp32=[bev_pool]"])


def _cpu_target(pipeline, min_fps):
    # the p99 bar is left loose: on a shared 2-core machine single runs stall for ~10 ms now and then
    return dataclasses.replace(load_target("cpu", pipeline), min_fps=min_fps, max_p99_latency_ms=1000.0)


def test_cpu_target_is_measured_and_passes(tmp_path, pipeline):
    result = run_deploy(_spec(make_net()), "cpu", _cpu_target(pipeline, 150.0), pipeline.export, tmp_path, log=lambda m: None)
    assert result["passed"], result["failures"]
    assert result["fps"]["mode"] == "measured" and "ONNX Runtime" in result["fps"]["how"]
    assert {"model.onnx", "model.int8.onnx", "report.md", "gate.json", "latency.png",
            "calibration.onnxruntime-cpu.json"} <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is True
    report = (tmp_path / "report.md").read_text()
    assert "PASS" in report and "MEASURED" in report and "predicted" not in report.lower()
    assert "| segmentation | seg_rel_error |" in report and "Never quantized (export.keep_fp32 ['bev_pool']): 3 nodes" in report
    assert set(result["speed"]["side_by_side"]) == {"model.int8.onnx", "model.onnx"}


@pytest.mark.slow
def test_deliberately_slowed_model_fails_the_measured_gate(tmp_path, pipeline):
    """~5 GFLOP of extra convolutions (hundreds of times the normal network's work) fail a bar that the
    normal network, measured in the same test, clears 3x over: relative, so a fast or a busy machine
    decides the same way."""
    normal = run_deploy(_spec(make_net()), "cpu", _cpu_target(pipeline, 1.0), pipeline.export,
                        tmp_path / "normal", log=lambda m: None)
    bar = round(normal["fps"]["fps"] / 3.0, 1)
    result = run_deploy(_spec(make_net(slow=True)), "cpu", _cpu_target(pipeline, bar), pipeline.export,
                        tmp_path / "slow", log=lambda m: None)
    assert normal["passed"] and not result["passed"], (normal["fps"], result["fps"])
    assert any(f"below the required {bar:g} FPS" in reason for reason in result["failures"])
    assert "FAIL" in (tmp_path / "slow" / "report.md").read_text().splitlines()[0]


def test_tensorrt_target_without_tensorrt_is_predicted_with_a_build_script(tmp_path, pipeline):
    if "tensorrt" in sys.modules:
        pytest.skip("TensorRT is importable: this machine measures instead of predicting")
    orin = load_target("orin", pipeline)
    result = run_deploy(_spec(make_net()), "orin", orin, pipeline.export, tmp_path, log=lambda m: None)
    assert result["passed"], result["failures"]
    assert result["fps"]["mode"] == "predicted" and "roofline" in result["fps"]["how"]
    report = (tmp_path / "report.md").read_text()
    assert "PREDICTED" in report and "MEASURED" not in report
    script = (tmp_path / "build_engine.sh").read_text()
    assert "trtexec --onnx=model.int8.onnx --saveEngine=orin.engine" in script and "--int8" in script and "--fp16" in script
    assert result["export"]["tensorrt_problems"] == []


def test_predicted_gate_fails_when_the_target_bar_is_out_of_reach(tmp_path, pipeline):
    orin = dataclasses.replace(load_target("orin", pipeline), min_fps=1e6)
    result = run_deploy(_spec(make_net()), "orin", orin, pipeline.export, tmp_path, log=lambda m: None)
    assert not result["passed"] and any("predicted" in r and "below" in r for r in result["failures"])


def test_measured_gate_normalises_by_the_reference_workload():
    from stack.deploy.gate import measured_gate
    from stack.deploy.runtime import LatencyStats

    target = dataclasses.replace(load_target("ci-cpu", load_pipeline()), min_fps=10.0, max_p99_latency_ms=200.0,
                                 reference_workload_ms=5.0)
    stats = LatencyStats(median_ms=150.0, p99_ms=300.0, mean_ms=150.0, runs=100)
    busy = measured_gate(target, stats, "ORT", reference_now_ms=10.0)  # machine runs 2x slower right now
    assert busy.passed and busy.scale == pytest.approx(0.5) and busy.median_ms == pytest.approx(75.0)
    raw = measured_gate(dataclasses.replace(target, reference_workload_ms=0.0), stats, "ORT", reference_now_ms=10.0)
    assert not raw.passed and len(raw.reasons) == 2
