"""The accuracy gate: a planted outlier layer fails INT8, is found, kept fp32, and passes; each head's drop
carries a paired bootstrap interval over frames, and the gate's rule for an interval straddling the budget."""

import numpy as np
import onnx
import pytest

from stack.deploy.gates.accuracy import (BOOTSTRAP_LEVEL, HeadBudget, HeadResult, accuracy_gate, compare, frame_means,
                                   paired_bootstrap)
from stack.deploy.export import export_onnx
from stack.deploy.quantize import quantizable_nodes, quantize

from deploy_fixture_net import example_inputs, make_net, make_samples

BUDGETS = [HeadBudget("segmentation", "seg_rel_error", 0.05, False), HeadBudget("speed", "speed_mae", 0.05, False)]


def make_evaluator(samples, teacher):
    """Segmentation: relative L2 error of the logits; speed: mean |error|; both against the fp32 net."""
    labels = [teacher(feeds) for feeds in samples]

    def evaluate(run):
        frames = []
        for feeds, label in zip(samples, labels):
            out = run(feeds)
            seg = float(np.linalg.norm(out["segmentation"] - label["segmentation"]) / np.linalg.norm(label["segmentation"]))
            error = float(np.abs(out["speed"] - label["speed"] - 0.5).mean())  # label offset: fp32 is not perfect
            frames.append({"seg_rel_error": seg, "speed_mae": error})
        return frame_means(frames)

    return evaluate


def _setup(tmp_path, outlier):
    net = make_net(outlier=outlier)
    fp32 = tmp_path / "net.onnx"
    export_onnx(net, example_inputs(), ["segmentation", "speed"], fp32, opset=17, metadata={})
    calibration, validation = make_samples(8, seed=1), make_samples(6, seed=2)
    from stack.deploy.gates.accuracy import session_runner

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
    # the final attempt's metrics travel with the report, for the figures it prints without a budget
    recorded = report.to_dict()["quantized_metrics"]
    assert set(recorded) == {"seg_rel_error", "speed_mae"} and recorded["seg_rel_error"] == report.final.heads[0].quantized


def test_report_prints_nds_of_fp32_and_int8_as_information():
    """NDS and the TP errors are no gate: the report lists them for both models, and says which the network
    does not predict, rather than quoting the devkit's 1 as a measurement."""
    from stack.deploy.report import _accuracy_section

    def figures(nds):
        return {"detection/NDS": nds, "detection/mAP": 0.2, "detection/mATE": 0.7, "detection/mASE": 0.26,
                "detection/mAOE": 0.48, "detection/mAVE": 1.3, "detection/mAAE": 1.0, "detection/predictions": 90.0,
                "detection/predictions_with_velocity": 90.0, "detection/predictions_with_attribute": 0.0,
                "detection/gt_boxes": 80.0, "detection/gt_with_attribute": 0.0}

    head = {"head": "detection", "metric": "detection_map", "fp32": 0.2, "quantized": 0.19, "drop": 0.01,
            "budget": 0.02, "passed": True, "conclusive": True, "low": float("nan"), "high": float("nan"), "frames": 60}
    accuracy = {"heads": [head], "excluded": [], "attempts": [{}], "fp32_metrics": figures(0.312),
                "quantized_metrics": figures(0.305)}
    text = "\n".join(_accuracy_section(accuracy))
    assert "- fp32: NDS 0.312 (mAP 0.200; mATE 0.700" in text and "- INT8: NDS 0.305" in text
    assert text.count("no attribute head") == 2 and "no velocity head" not in text
    del accuracy["quantized_metrics"]  # a bundle gated before the figures were recorded
    assert "INT8: NDS" not in "\n".join(_accuracy_section(accuracy))


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
    summary = report.to_dict()
    assert summary["passed"] is False and summary["bootstrap"]["resamples"] > 0
    seg = next(h for h in report.final.heads if h.head == "segmentation")
    assert not seg.passed and seg.conclusive and seg.low > seg.budget  # the damage is beyond doubt on 6 frames
    assert seg.low <= seg.drop <= seg.high and seg.frames == 6


def _synthetic_scores(frames: int, drop: float, seed: int):
    """Per-frame scores where INT8 is worse than fp32 by `drop` on average, with frame-to-frame spread."""
    rng = np.random.default_rng(seed)
    fp32 = rng.uniform(0.2, 0.8, frames)
    quantized = fp32 - drop + rng.normal(0.0, 0.02, frames)
    return frame_means([{"m": v} for v in fp32]), frame_means([{"m": v} for v in quantized])


def test_bootstrap_interval_covers_the_drop_and_shrinks_with_more_frames():
    budget = [HeadBudget("head", "m", 0.02, True)]
    widths = []
    for frames in (20, 320):
        fp32, quantized = _synthetic_scores(frames, drop=0.01, seed=frames)
        (low, high), = paired_bootstrap(fp32, quantized, budget, resamples=400, level=BOOTSTRAP_LEVEL).values()
        point = fp32.metrics["m"] - quantized.metrics["m"]
        assert low <= point <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2.5, widths  # ~1/sqrt(N): 16x the frames, ~4x narrower
    covered = 0
    for seed in range(40):  # and the 90% interval holds the true drop about 90% of the time
        fp32, quantized = _synthetic_scores(20, drop=0.01, seed=100 + seed)
        (low, high), = paired_bootstrap(fp32, quantized, budget, resamples=200, level=BOOTSTRAP_LEVEL).values()
        covered += low <= 0.01 <= high
    assert covered >= 32, covered


def test_interval_straddling_the_budget_passes_on_the_point_estimate_but_says_inconclusive():
    fp32, quantized = _synthetic_scores(12, drop=0.018, seed=3)
    head, = compare(fp32, quantized, [HeadBudget("head", "m", 0.02, True)])
    assert head.low < head.budget < head.high, head
    assert head.passed == (head.drop <= head.budget) and not head.conclusive
    assert "inconclusive at 12 frames" in head.verdict()
    clear, = compare(*_synthetic_scores(400, drop=0.0, seed=4), [HeadBudget("head", "m", 0.02, True)])
    assert clear.passed and clear.conclusive and clear.verdict() == "pass"


def test_int8_that_loses_to_the_planners_prior_fails_even_within_budget():
    """fp32 L2 0.70 beats 0.85 x rollout 0.85 = 0.7225; INT8 at 0.75 is within the 0.10 m budget but no longer does."""
    budget = HeadBudget("planning", "l2", 0.10, False, prior_metric="rollout", prior_factor=0.85)
    head, = compare({"l2": 0.70, "rollout": 0.85}, {"l2": 0.75, "rollout": 0.85}, [budget])
    assert head.drop <= head.budget and head.loses_prior and not head.passed
    kept, = compare({"l2": 0.70, "rollout": 0.85}, {"l2": 0.71, "rollout": 0.85}, [budget])
    assert kept.passed
    untrained, = compare({"l2": 0.85, "rollout": 0.85}, {"l2": 0.86, "rollout": 0.85}, [budget])
    assert untrained.passed and not untrained.loses_prior  # quantization did not cost what fp32 never had
    assert isinstance(untrained, HeadResult)


def test_drop_sign_follows_metric_direction():
    rows = compare({"a": 0.8, "b": 1.0}, {"a": 0.7, "b": 1.2}, [HeadBudget("x", "a", 0.05, True), HeadBudget("y", "b", 0.5, False)])
    assert rows[0].drop == pytest.approx(0.1) and not rows[0].passed
    assert rows[1].drop == pytest.approx(0.2) and rows[1].passed


def test_screen_ranks_the_outlier_first_in_one_pass(tmp_path):
    from stack.deploy.gates.accuracy import screen

    fp32, _, quantize_with, candidates, few = _setup(tmp_path, outlier=True)
    ranked = screen(fp32, quantize_with([]), candidates, few)
    assert sorted(ranked) == sorted(candidates)
    assert {"/net/outlier/conv/Conv", "/net/outlier/mix/Conv"} <= set(ranked[:3]), ranked[:5]


@pytest.mark.parametrize("train_frames, sensitivity", [(64, 0), (66, 2), (68, 4), (500, 4)])
def test_sensitivity_frames_never_shrink_the_calibration_set(monkeypatch, train_frames, sensitivity):
    from stack.config import load_pipeline
    from stack.deploy import validation

    monkeypatch.setattr(validation, "split_size", lambda pipeline, split: train_frames if split == "train" else 10)
    monkeypatch.setattr(validation, "read_split", lambda pipeline, split, ids: [(i, f"{split}/{i}") for i in ids])
    pipeline = load_pipeline(["configs/pipeline.yaml"], ["export.calibration_samples=64", "export.sensitivity_samples=4"])
    samples = validation.deploy_samples(pipeline)
    assert len(samples.calibration) == 64 and len(samples.sensitivity) == sensitivity
    assert not set(samples.calibration) & set(samples.sensitivity)
