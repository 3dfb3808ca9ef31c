"""The deploy bundle on the stand-in network: files, report wording, and the FPS gate's verdicts."""

import dataclasses
import json
import sys

import pytest

from stack.config import load_pipeline, load_target
from stack.deploy.gates.accuracy import HeadBudget
from stack.deploy.orchestrate import DeploySpec, run_deploy

from deploy_fixture_net import drives, example_inputs, heads_like_the_recipe, make_net, make_samples, segmentation_error


def _spec(net):
    feeds = make_samples(12, seed=3)
    return DeploySpec(net, example_inputs(), ["segmentation", "speed"], {"pipeline_hash": "test"}, feeds[:8],
                      feeds[8:], segmentation_error(net, feeds[8:]), [HeadBudget("segmentation", "seg_rel_error", 0.05, False)],
                      "fixture samples", "fixture.pt", "fixture", "test", closed_loop=drives(0.2),
                      quality_evaluator=heads_like_the_recipe)


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(["configs/pipeline.yaml"], ["export.calibration_samples=8", "export.timing_runs=30",
                                                     "export.keep_fp32=[bev_pool]"])


def _cpu_target(pipeline, min_fps):
    # the p99 bar is left loose: on a shared 2-core machine single runs stall for ~10 ms now and then
    return dataclasses.replace(load_target("cpu", pipeline), min_fps=min_fps, max_p99_latency_ms=1000.0)


def test_cpu_target_is_measured_and_passes(tmp_path, pipeline):
    result = run_deploy(_spec(make_net()), "cpu", _cpu_target(pipeline, 50.0), pipeline.export, tmp_path, log=lambda m: None)
    assert result["passed"], result["failures"]
    assert result["fps"]["mode"] == "measured" and "ONNX Runtime" in result["fps"]["how"]
    assert {"model.onnx", "model.int8.onnx", "report.md", "gate.json", "latency.png",
            "calibration.onnxruntime-cpu.json"} <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is True
    report = (tmp_path / "report.md").read_text()
    assert "PASS" in report and "MEASURED" in report and "predicted" not in report.lower()
    assert "| segmentation | seg_rel_error |" in report and "Never quantized (export.keep_fp32 ['bev_pool']): 3 nodes" in report
    assert set(result["speed"]["side_by_side"]) == {"model.int8.onnx", "model.onnx"}


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory, pipeline):
    """(the tiny preset's fp32 graph with random weights, its example feeds, the tiny pipeline)."""
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network
    from stack.models import build_model

    tiny = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])
    network = export_network(tiny, build_model(tiny).state_dict())
    path = export_onnx(network.net, network.example, network.output_names, tmp_path_factory.mktemp("tiny") / "m.onnx",
                       tiny.export.opset, network.metadata).path
    return path, {name: value.numpy() for name, value in network.example.items()}, tiny


@pytest.mark.slow
@pytest.mark.serial  # judges measured time: alone, after `make test`'s parallel run
def test_tiny_network_passes_ci_cpu_and_twice_its_work_does_not(tiny_onnx):
    """ci-cpu's own bars (median bar sqrt(2) x the recipe's latency, normalised by the recipe network's frozen
    graph, decided on the 90% interval of the rounds' normalised medians), timed side by side as deploy times
    them: the tiny network clears them; the same graph run twice per frame (exactly 2x the work) is refused,
    failed or inconclusive, never passed, on whatever CPU runs the test."""
    from functools import partial

    from stack.deploy.gates.fps import (MAX_TIMING_ROUNDS, TIMING_ROUNDS, TIMING_SPINS, conclusive, measured_gate,
                                        time_side_by_side)
    from stack.deploy.runtime import RepeatedSession, gate_reference, ort_session

    path, feeds, tiny = tiny_onnx
    target = load_target("ci-cpu", tiny)
    assert target.max_p99_latency_ms == pytest.approx(83.333)
    session = ort_session(path, spinning=TIMING_SPINS)
    times, reference = time_side_by_side({"tiny": session, "slowed": RepeatedSession(session, 2)}, feeds, 100, 5,
                                         gate_reference(target), settled=partial(conclusive, target))
    normal = measured_gate(target, times["tiny"], "ONNX Runtime CPU", reference)
    slowed = measured_gate(target, times["slowed"], "ONNX Runtime CPU", reference)
    assert normal.passed and normal.verdict == "pass", normal.to_dict()
    assert not slowed.passed and slowed.verdict in ("fail", "inconclusive"), slowed.to_dict()
    assert len(normal.repeats_ms) % TIMING_ROUNDS == 0 and len(normal.repeats_ms) <= MAX_TIMING_ROUNDS
    assert slowed.median_ms > 1.5 * normal.median_ms


def test_the_reference_workload_costs_what_the_network_it_froze_costs(tiny_onnx, tmp_path):
    """A frozen graph keeps the network's structure and integer tensors and redraws its float weights from their
    statistics: it computes finite outputs of the network's shapes, is a fraction of the file, and a missing or
    foreign reference file is refused with what to do."""
    import numpy as np
    import onnx

    from stack.deploy.reference_graph import example_feeds, freeze, thaw
    from stack.deploy.runtime import ort_session
    from stack.errors import StackError

    path, feeds, _ = tiny_onnx
    frozen = freeze(path, tmp_path / "reference.onnx.gz")
    assert frozen.stat().st_size < path.stat().st_size / 10
    model = thaw(frozen)
    original = onnx.load(str(path))
    assert [n.op_type for n in onnx.load_from_string(model).graph.node] == [n.op_type for n in original.graph.node]
    outputs = ort_session(model).run(None, example_feeds(model))
    expected = ort_session(path).run(None, feeds)
    assert [o.shape for o in outputs] == [e.shape for e in expected]
    assert all(np.isfinite(o).all() for o in outputs if o.dtype.kind == "f")
    with pytest.raises(StackError, match="not a frozen reference graph"):
        thaw(path)


def test_a_hostile_frozen_graph_is_refused_before_it_fills_memory(tiny_onnx, tmp_path):
    """target.reference_graph names a file in the user's folder: a gzip bomb, a statistics entry that would
    draw 2^40 values, a malformed entry, a corrupt gzip or bytes that are no ONNX graph is one StackError,
    decompression and drawing bounded."""
    import gzip

    import onnx

    from stack.deploy import reference_graph
    from stack.deploy.reference_graph import FLOAT_STATS_KEY, freeze, thaw
    from stack.errors import StackError

    bomb = tmp_path / "bomb.onnx.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as handle:
        for _ in range(3):
            handle.write(bytes(1024 ** 2))
    original_limit = reference_graph.MAX_GRAPH_BYTES
    reference_graph.MAX_GRAPH_BYTES = 2 * 1024 ** 2  # the limit scaled down: the real one is 2 GiB
    try:
        with pytest.raises(StackError, match="decompresses to more than 2 MiB"):
            thaw(bomb)
    finally:
        reference_graph.MAX_GRAPH_BYTES = original_limit
    corrupt = tmp_path / "corrupt.onnx.gz"
    corrupt.write_bytes(gzip.compress(b"x" * 1000)[:12] + b"\x00" * 50)
    for path, needle in ((corrupt, "cannot be decompressed"), (tmp_path / "notes.onnx", "not an ONNX graph")):
        if path.suffix == ".onnx":
            path.write_bytes(b"\xff" * 64)
        with pytest.raises(StackError, match=needle):
            thaw(path)
    frozen = freeze(tiny_onnx[0], tmp_path / "reference.onnx")
    for stats, needle in ((json.dumps([["w", "float32", [2 ** 20, 2 ** 20], 0.0, 1.0]]), "more than 268,435,456"),
                          (json.dumps([["w", "object", [2], 0.0, 1.0]]), "expected [name, float dtype"),
                          (json.dumps([["w", "float32", [2], 0.0, -1.0]]), "expected [name, float dtype"),
                          ("[" * 1000 + "]" * 1000, "nested more than 64 levels deep")):
        model = onnx.load(str(frozen))
        next(e for e in model.metadata_props if e.key == FLOAT_STATS_KEY).value = stats
        path = tmp_path / "edited.onnx"
        path.write_bytes(model.SerializeToString())
        with pytest.raises(StackError) as caught:
            thaw(path)
        assert needle in str(caught.value) and "stack bench fps-bar" in str(caught.value), caught.value


def test_a_normalised_target_without_its_reference_graph_is_refused():
    """reference_workload_ms > 0 needs the frozen graph it was measured with: a missing file is a config error
    naming the key, not a traceback in the middle of a deploy."""
    from stack.config import ConfigError

    with pytest.raises(ConfigError, match="reference_graph"):
        load_pipeline(["configs/pipeline.yaml"], ["targets.ci-cpu.reference_graph=missing.onnx.gz"])


class _Instant:
    """A stand-in session that returns at once: the timing loop's bookkeeping without a model."""

    def run(self, names, feeds):
        return []


def test_an_inconclusive_timing_buys_more_rounds_up_to_the_cap():
    """Deploy times more rounds while `settled` says a verdict is undecided, TIMING_ROUNDS at a time, and stops
    at MAX_TIMING_ROUNDS; a verdict decided after the first rounds is not timed again."""
    from stack.deploy.gates.fps import MAX_TIMING_ROUNDS, TIMING_ROUNDS, time_side_by_side

    looks = []

    def settles_on_second_look(times, reference):
        looks.append(len(times["m"].round_medians_ms))
        return len(looks) == 2

    times, _ = time_side_by_side({"m": _Instant()}, {}, TIMING_ROUNDS, 1, settled=settles_on_second_look)
    assert looks == [TIMING_ROUNDS, 2 * TIMING_ROUNDS] and len(times["m"].round_medians_ms) == 2 * TIMING_ROUNDS
    times, _ = time_side_by_side({"m": _Instant()}, {}, TIMING_ROUNDS, 1, settled=lambda t, r: False)
    assert len(times["m"].round_medians_ms) == MAX_TIMING_ROUNDS
    times, _ = time_side_by_side({"m": _Instant()}, {}, TIMING_ROUNDS, 1, settled=lambda t, r: True)
    assert len(times["m"].round_medians_ms) == TIMING_ROUNDS


def test_conclusive_is_false_only_while_a_timed_model_straddles_the_bar():
    """`conclusive` judges the normalised repeats as the gate does: a straddling model keeps the timing going."""
    from stack.deploy.gates.fps import conclusive
    from stack.deploy.runtime import LatencyStats

    target = dataclasses.replace(load_target("ci-cpu", load_pipeline()), min_fps=40.0, max_p99_latency_ms=80.0)

    def timed(repeats):
        stats = LatencyStats(24.0, 30.0, 24.0, 100)
        stats.round_medians_ms, stats.round_reference_ms = repeats, [target.reference_workload_ms] * len(repeats)
        return stats

    fast, straddling = timed([19.0, 20.0, 21.0, 20.0, 20.5]), timed([18.0, 30.0, 22.0, 27.0, 24.0])
    assert conclusive(target, {"a": fast}, target.reference_workload_ms)
    assert not conclusive(target, {"a": fast, "b": straddling}, target.reference_workload_ms)
    narrowed = timed([18.0, 30.0, 22.0, 27.0, 24.0] + [20.0, 21.0, 19.5, 20.5, 21.0] * 3)
    assert conclusive(target, {"b": narrowed}, target.reference_workload_ms)


def test_an_inconclusive_measured_verdict_fails_unless_the_target_allows_it():
    """Repeats whose interval straddles the bar: inconclusive, a failed gate by default; a clear margin on
    either side decides. No timing: hand-made repeats."""
    from stack.deploy.gates.fps import decide

    target = dataclasses.replace(load_target("ci-cpu", load_pipeline()), min_fps=40.0, max_p99_latency_ms=80.0)
    straddling = decide("measured", "test", 24.0, 40.0, target, repeats_ms=[18.0, 30.0, 22.0, 27.0, 24.0])
    assert straddling.verdict == "inconclusive" and not straddling.passed and "inconclusive" in straddling.reasons[0]
    allowed = decide("measured", "test", 24.0, 40.0, dataclasses.replace(target, timing_inconclusive_passes=True),
                     repeats_ms=[18.0, 30.0, 22.0, 27.0, 24.0])
    assert allowed.verdict == "inconclusive" and allowed.passed
    assert decide("measured", "t", 20.0, 40.0, target, repeats_ms=[19.0, 20.0, 21.0, 20.0, 20.5]).verdict == "pass"
    slow = decide("measured", "t", 40.0, 60.0, target, repeats_ms=[38.0, 40.0, 42.0, 40.0, 41.0])
    assert slow.verdict == "fail" and not slow.passed


def test_the_predicted_p99_bar_can_fail_below_half_the_period():
    """orin gives the network half the 83.3 ms period (network_share 0.5); the other stages take the other
    half, so the p99 bar is 41.7 ms, and a prediction whose median fits the budget can still fail on its tail."""
    from stack.deploy.gates.fps import predicted_gate
    from stack.deploy.latency.roofline import P99_OVER_MEDIAN, LayerCost, Prediction

    orin = load_target("orin", load_pipeline())
    assert orin.network_share <= 0.5 and orin.max_p99_latency_ms == pytest.approx(orin.latency_budget_ms(), abs=1e-3)
    median = 0.95 * orin.latency_budget_ms()  # fits the median bar
    gate = predicted_gate(orin, Prediction([LayerCost("net", ["Conv"], "int8", 1.0, 1.0, median, "compute")]), "t")
    assert gate.fps >= orin.min_fps and gate.p99_ms == pytest.approx(median * P99_OVER_MEDIAN)
    assert not gate.passed and "p99" in gate.reasons[0]


def _orin_gate(model, pipeline, all_int8: bool):
    from stack.deploy.gates.fps import predicted_gate
    from stack.deploy.latency.margins import target_margin
    from stack.deploy.latency.roofline import predict

    orin = load_target("orin", pipeline)
    prediction = predict(model, orin, keep_fp32=tuple(pipeline.export.keep_fp32), all_int8=all_int8)
    return predicted_gate(orin, prediction, "test", target_margin("orin"))


@pytest.mark.slow
def test_tiny_network_passes_the_orin_budget_even_without_int8(tiny_onnx):
    import onnx

    path, _, tiny = tiny_onnx
    gate = _orin_gate(onnx.load(str(path)), tiny, all_int8=False)  # FP16 everywhere: slower than any INT8 build
    assert gate.passed and gate.budget_ms == pytest.approx(1000 / 12 / 2) and gate.headroom > 1, gate.to_dict()


@pytest.mark.slow
def test_large_preset_fails_the_orin_budget_even_all_int8(tmp_path):
    """The large preset (ResNet-50, 6 x 1408x512, 200x200 BEV, 96 depth bins; random weights: latency does not
    depend on them) predicted on AGX Orin with every conv and matmul in INT8, the most optimistic build, still
    misses the 41.7 ms budget (half of the 12 Hz frame period)."""
    import onnx

    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network
    from stack.models import build_model

    large = load_pipeline(["configs/pipeline.yaml", "configs/presets/large.yaml"])
    network = export_network(large, build_model(large).state_dict())
    path = export_onnx(network.net, network.example, network.output_names, tmp_path / "large.onnx", large.export.opset,
                       network.metadata).path
    gate = _orin_gate(onnx.load(str(path)), large, all_int8=True)
    assert not gate.passed and gate.headroom < 1, gate.to_dict()
    assert any("below the required 24 FPS" in reason and "budget 41.7 ms" in reason for reason in gate.reasons), gate.reasons


def _timings(int8_ms: float, fp32_ms: float):
    from stack.deploy.runtime import LatencyStats

    def fake(paths, feeds, cfg, target):
        table = {"model.int8.onnx": int8_ms, "model.onnx": fp32_ms}
        return {p.name: LatencyStats(table[p.name], table[p.name] * 1.2, table[p.name], 30) for p in paths}, 1.0
    return fake


def _best_cpu(pipeline):
    return dataclasses.replace(load_target("cpu", pipeline), precision="best", min_fps=0.5, max_p99_latency_ms=1e4)


def test_int8_slower_than_fp32_ships_fp32_and_says_why(tmp_path, pipeline, monkeypatch):
    from stack.deploy import orchestrate

    monkeypatch.setattr(orchestrate, "_time_side_by_side", _timings(int8_ms=34.0, fp32_ms=27.3))
    result = run_deploy(_spec(make_net()), "cpu", _best_cpu(pipeline), pipeline.export, tmp_path / "b",
                        log=lambda m: None)
    gate = json.loads((tmp_path / "b" / "gate.json").read_text())
    assert result["passed"] and gate["shipped"]["file"] == "model.onnx" and gate["shipped"]["precision"] == "fp32"
    assert "not faster" in gate["shipped"]["why"] and "1.25x" in gate["shipped"]["why"]
    assert gate["fps"]["median_ms"] == pytest.approx(27.3)  # the FPS gate judges the shipped model
    assert "Shipped: `model.onnx` (fp32)" in (tmp_path / "b" / "report.md").read_text()


def test_int8_faster_ships_int8_unless_it_fails_accuracy(tmp_path, pipeline, monkeypatch):
    from stack.deploy import orchestrate

    monkeypatch.setattr(orchestrate, "_time_side_by_side", _timings(int8_ms=15.0, fp32_ms=30.0))
    fast = run_deploy(_spec(make_net()), "cpu", _best_cpu(pipeline), pipeline.export, tmp_path / "fast",
                      log=lambda m: None)
    assert fast["shipped"]["file"] == "model.int8.onnx" and "2.00x faster" in fast["shipped"]["why"]
    assert fast["fps"]["median_ms"] == pytest.approx(15.0)
    strict = dataclasses.replace(pipeline.export, max_fp32_layers=0)
    spec = _spec(make_net(outlier=True))
    spec.budgets = [HeadBudget("segmentation", "seg_rel_error", 0.001, False)]
    damaged = run_deploy(spec, "cpu", _best_cpu(pipeline), strict, tmp_path / "damaged", log=lambda m: None)
    assert not damaged["accuracy"]["passed"] and damaged["passed"], damaged["failures"]
    assert damaged["shipped"]["file"] == "model.onnx" and "fails the accuracy gate" in damaged["shipped"]["why"]
    forced = run_deploy(spec, "cpu", dataclasses.replace(_best_cpu(pipeline), precision="int8"), strict,
                        tmp_path / "forced", log=lambda m: None)
    assert not forced["passed"] and forced["shipped"]["file"] == "model.int8.onnx"
    assert any(reason.startswith("accuracy: segmentation") for reason in forced["failures"])


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
    assert "trtexec --onnx=model.int8.onnx --saveEngine=" in script and "orin.engine" in script
    assert "--int8" in script and "--fp16" in script
    assert result["export"]["tensorrt_problems"] == []


def test_predicted_gate_fails_when_the_target_bar_is_out_of_reach(tmp_path, pipeline):
    orin = dataclasses.replace(load_target("orin", pipeline), min_fps=1e6)
    result = run_deploy(_spec(make_net()), "orin", orin, pipeline.export, tmp_path, log=lambda m: None)
    assert not result["passed"] and any("predicted" in r and "below" in r for r in result["failures"])


def test_measured_gate_normalises_by_the_reference_workload():
    from stack.deploy.gates.fps import measured_gate
    from stack.deploy.runtime import LatencyStats

    target = dataclasses.replace(load_target("ci-cpu", load_pipeline()), min_fps=10.0, max_p99_latency_ms=200.0,
                                 reference_workload_ms=5.0)
    stats = LatencyStats(median_ms=150.0, p99_ms=300.0, mean_ms=150.0, runs=100)
    busy = measured_gate(target, stats, "ORT", reference_now_ms=10.0)  # machine runs 2x slower right now
    assert busy.passed and busy.scale == pytest.approx(0.5) and busy.median_ms == pytest.approx(75.0)
    raw = measured_gate(dataclasses.replace(target, reference_workload_ms=0.0), stats, "ORT", reference_now_ms=10.0)
    assert not raw.passed and len(raw.reasons) == 2
