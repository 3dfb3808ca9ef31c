"""The accuracy gate's fallback loop: a planted outlier layer fails INT8, is found, kept fp32, and passes."""

import numpy as np
import onnx
import pytest

from stack.deploy.accuracy import HeadBudget, accuracy_gate, compare
from stack.deploy.export import export_onnx
from stack.deploy.quantize import quantizable_nodes, quantize

from deploy_fixture_net import example_inputs, make_net, make_samples

BUDGETS = [HeadBudget("segmentation", "seg_rel_error", 0.05, False), HeadBudget("speed", "speed_mae", 0.05, False)]


def make_evaluator(samples, teacher):
    """Segmentation: relative L2 error of the logits; speed: mean |error|; both against the fp32 net."""
    labels = [teacher(feeds) for feeds in samples]

    def evaluate(run):
        seg, error = [], []
        for feeds, label in zip(samples, labels):
            out = run(feeds)
            seg.append(float(np.linalg.norm(out["segmentation"] - label["segmentation"]) / np.linalg.norm(label["segmentation"])))
            error.append(float(np.abs(out["speed"] - label["speed"] - 0.5).mean()))  # label offset: fp32 is not perfect
        return {"seg_rel_error": float(np.mean(seg)), "speed_mae": float(np.mean(error))}

    return evaluate


def _setup(tmp_path, outlier):
    net = make_net(outlier=outlier)
    fp32 = tmp_path / "net.onnx"
    export_onnx(net, example_inputs(), ["segmentation", "speed"], fp32, opset=17, metadata={})
    calibration, validation = make_samples(8, seed=1), make_samples(6, seed=2)
    from stack.deploy.accuracy import session_runner

    evaluate = make_evaluator(validation, session_runner(fp32))
    counter = iter(range(1000))

    def quantize_with(excluded):
        return quantize(fp32, tmp_path / f"q{next(counter)}.onnx", "tensorrt", calibration, tmp_path / "calib.json",
                        keep_fp32=["bev_pool"], exclude=excluded).path

    candidates = quantizable_nodes(onnx.load(str(fp32)), keep_fp32=["bev_pool"])
    return fp32, evaluate, quantize_with, candidates, validation[:2]


def test_clean_network_passes_without_exclusions(tmp_path):
    fp32, evaluate, quantize_with, candidates, few = _setup(tmp_path, outlier=False)
    report = accuracy_gate(fp32, quantize_with, evaluate, BUDGETS, candidates, few, max_fp32_layers=8, log=lambda m: None,
                           simulate_int8=True)
    assert report.passed and len(report.attempts) == 1 and report.final.excluded == []
    assert not report.sensitivity


def test_outlier_layer_fails_int8_then_is_kept_fp32(tmp_path):
    fp32, evaluate, quantize_with, candidates, few = _setup(tmp_path, outlier=True)
    messages = []
    report = accuracy_gate(fp32, quantize_with, evaluate, BUDGETS, candidates, few, max_fp32_layers=8, log=messages.append,
                           simulate_int8=True)
    first = report.attempts[0]
    assert not first.passed  # plain INT8 breaks at least one head
    top = [name for name, _ in report.sensitivity[:2]]
    assert any("outlier" in name for name in top), report.sensitivity[:4]
    assert report.passed, report.to_dict()
    assert report.final.excluded and all(name in candidates for name in report.final.excluded)
    assert any("outlier" in name for name in report.final.excluded)
    assert "FAIL" in messages[0] and "PASS" in messages[-1]
    quantized = onnx.load(str(report.quantized_path))
    assert any(n.op_type == "QuantizeLinear" for n in quantized.graph.node)  # still an INT8 model


def test_gate_reports_failure_when_fp32_budget_is_spent(tmp_path):
    fp32, evaluate, quantize_with, candidates, few = _setup(tmp_path, outlier=True)
    report = accuracy_gate(fp32, quantize_with, evaluate, BUDGETS, candidates, few, max_fp32_layers=0, log=lambda m: None,
                           simulate_int8=True)
    assert not report.passed and len(report.attempts) == 1
    assert report.to_dict()["passed"] is False


def test_drop_sign_follows_metric_direction():
    rows = compare({"a": 0.8, "b": 1.0}, {"a": 0.7, "b": 1.2}, [HeadBudget("x", "a", 0.05, True), HeadBudget("y", "b", 0.5, False)])
    assert rows[0].drop == pytest.approx(0.1) and not rows[0].passed
    assert rows[1].drop == pytest.approx(0.2) and rows[1].passed


def test_screen_ranks_the_outlier_first_in_one_pass(tmp_path):
    from stack.deploy.accuracy import screen

    fp32, _, quantize_with, candidates, few = _setup(tmp_path, outlier=True)
    ranked = screen(fp32, quantize_with([]), candidates, few)
    assert sorted(ranked) == sorted(candidates)
    assert {"/net/outlier/conv/Conv", "/net/outlier/Mul"} <= set(ranked[:3]), ranked[:5]
