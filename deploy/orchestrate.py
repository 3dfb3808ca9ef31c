"""Orchestration of `stack deploy`: from a trained network to a bundle that passed (or failed) the target's gates.

Steps, each recorded in the bundle (`report.md`, `gate.json`, `latency.png`):

1. export the fp32 ONNX, full checker, ONNX Runtime vs PyTorch parity per output;
   the quality gate's heads (`stack.deploy.gates.quality`): the fp32 model scored on the validation frames
   must clear `stack eval`'s bars;
2. for INT8 targets, quantize in the target's QDQ flavour, calibrated on training frames, and
   run the per-head accuracy gate on validation frames (with its fp32 fallback for sensitive
   layers, ranked on other training frames);
3. the closed loop (`stack.deploy.gates.closed_loop`): fp32, INT8 (when it passed the accuracy gate) and
   the blind policies drive the same held-out episodes: INT8 may not drive worse than fp32 by more than the
   budget, and fp32 must beat every blind policy (the quality gate's driving bar);
4. the FPS gate: measured with ONNX Runtime on `onnxruntime` targets, measured with
   TensorRT on the target's own GPU, otherwise predicted by the latency model, with
   `build_engine.sh` holding the exact trtexec line to build and time it on the device;
5. TensorRT targets also need every operator to import natively (no plugins).

The result is PASS only when every gate passes, quality included; `stack deploy` exits 0 on pass and 1 on
a failed gate (2 is reserved for bad input, raised as StackError before any gate runs). With
`allow_below_bar` (`--allow-below-bar`, for experiments) the quality gate's failures are listed under
`below_bar` instead of `failures`: the bundle can PASS its other gates but gate.json's `for_deployment` is
false and report.md says NOT FOR DEPLOYMENT; `DeployedNetwork.open` refuses such a bundle unless asked.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx

from stack.deploy.gates import accuracy as acc
from stack.deploy.bundle import check_replaceable, stage, swap_in, verify_bundle, vouch
from stack.deploy.export import check_parity, export_onnx
from stack.deploy.gates.fps import measured_gate, predicted_gate
from stack.deploy.quantize import check_calibration_set, fp32_nodes, quantizable_nodes, quantize
from stack.deploy.report import markdown, plot_latency, verdict_line, write_gate_json
from stack.deploy.trt_ops import tensorrt_problems
from stack.durable import disk_full
from stack.failpoints import fail_point

__all__ = ["DeploySpec", "run_deploy", "verify_bundle"]


@dataclass
class DeploySpec:
    """Everything deploy needs, independent of where the network came from."""

    net: object
    example: dict
    output_names: list
    metadata: dict
    calibration: list
    """Feed dicts for INT8 calibration."""
    accuracy_feeds: list
    """Feed dicts the accuracy gate scores (held-out validation frames, never calibration frames)."""
    evaluator: Callable
    """accuracy.Evaluator over `accuracy_feeds`."""
    budgets: list
    samples_source: str
    checkpoint: str = ""
    pipeline_name: str = ""
    pipeline_hash: str = ""
    extra_files: dict = field(default_factory=dict)
    """{file name: text} written into the bundle as they are (the pipeline's YAML, the calibration)."""
    sensitivity_feeds: list = field(default_factory=list)
    """Feed dicts that rank layers for the fp32 fallback: neither calibration nor accuracy frames
    (empty: the calibration feeds, never the accuracy ones)."""
    sample_ids: dict = field(default_factory=dict)
    """{"calibration" | "sensitivity" | "accuracy": [sample id, ...]}, recorded in gate.json."""
    closed_loop: Callable | None = None
    """closed_loop(int8_path or None, fp32_path, budget, latency_ms, log) -> result dict
    (`stack.deploy.gates.closed_loop.closed_loop_gate` bound to the pipeline); None: no closed-loop gate."""
    reference: object = None
    """Parity's reference (same call as `net`): the network pooling with `bev_pool` and the bundle
    calibration's geometry per call, as in training (None: `net` itself, baked against baked)."""
    data_root: str = ""
    """The dataset the calibration and accuracy samples come from (its fingerprint goes into gate.json)."""
    chosen_store: str | None = None
    """The tracking store the user chose for this deploy (`stack.train.tracking.chosen_store`): the checkpoint's run
    is logged into on a remote store only when it is this one (stack.lineage.attach_to_run)."""
    post_processing: dict = field(default_factory=dict)
    """The plan's post-processing the bundle ships (`stack.models.post_processing.post_processing_record`: the guard
    settings the closed-loop gate drives with and the decoding they read), recorded in gate.json; empty for a network
    that does not plan."""
    quality_evaluator: Callable | None = None
    """quality_evaluator(run) -> `stack eval`'s metrics dict of a runtime over the validation samples
    (`stack.deploy.gates.head_scores.make_quality_evaluator`); None: the heads are not judged (below the bar)."""


def run_deploy(spec: DeploySpec, name: str, target, export_cfg, folder: Path, log=print,
               allow_below_bar: bool = False) -> dict:
    """Build the bundle aside, run every gate, write the report, then swap it in at `folder` whole.
    `allow_below_bar`: a network below the quality bar still gets a bundle, marked not for deployment.

    Returns gate.json's content. A run killed at any point leaves the previous bundle at
    `folder` as it was (`stack.deploy.bundle`).
    """
    check_replaceable(folder)
    final, folder = folder, stage(folder)
    kept = (f"The bundle at {str(final)!r} is as it was" if final.exists() else f"Nothing was written at {final}") \
        + f" (the new one was being built in {folder}, now removed)"
    with disk_full(final.parent, kept, remove=folder):
        result = _build(spec, name, target, export_cfg, folder, log, allow_below_bar)
    swap_in(folder, final)
    log(f"{name}: {verdict_line(result)} -> {final / 'report.md'}")
    for reason in result["failures"] + result["below_bar"]:
        log(f"  {reason}")
    _attach(result, spec, name, final, log)
    return result


def _build(spec: DeploySpec, name: str, target, export_cfg, folder: Path, log, allow_below_bar: bool) -> dict:
    """Every file of the bundle in the staging `folder`, every gate run, gate.json last; its content."""
    result = {"target": name, "target_description": target.description, "runtime": target.runtime,
              "precision": target.precision, "qdq_flavour": target.qdq_flavour, "checkpoint": spec.checkpoint,
              "pipeline_name": spec.pipeline_name, "pipeline_hash": spec.pipeline_hash,
              "samples_source": spec.samples_source, "failures": []}
    if "calibration_hash" in spec.metadata:  # the camera calibration baked into the BEV pooling
        result["camera_calibration"] = {"name": spec.metadata.get("calibration", {}).get("name", ""),
                                        "hash": spec.metadata["calibration_hash"]}
    result.update(_lineage(spec, log))
    if spec.post_processing:
        result["post_processing"] = spec.post_processing
    for file_name, content in spec.extra_files.items():
        (folder / file_name).write_text(content)
    fp32_path = _export_step(spec, folder, export_cfg, result, log)
    heads = _head_quality_step(spec, fp32_path, log)
    engine_onnx = _quantize_step(spec, folder, fp32_path, name, target, export_cfg, result, log)
    _closed_loop_step(spec, engine_onnx, fp32_path, target, result, log)
    _finish_quality(heads, result, allow_below_bar, log)
    fail_point("deploy-after-quantize")
    _speed_step(spec, folder, engine_onnx, fp32_path, name, target, export_cfg, result, log)
    if target.runtime == "tensorrt":
        problems = tensorrt_problems(onnx.load(str(engine_onnx), load_external_data=False))
        result["export"]["tensorrt_problems"] = problems
        result["failures"] += [f"TensorRT import: {p}" for p in problems]
    result["passed"] = not result["failures"]
    result["for_deployment"] = result["passed"] and result["quality"]["passed"]
    listed = sorted({p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} | {"report.md", "gate.json"})
    (folder / "report.md").write_text(markdown(result, listed))
    write_gate_json(folder, vouch(folder, result, spec.checkpoint))
    return result


def _head_quality_step(spec: DeploySpec, fp32_path: Path, log) -> dict:
    """The quality gate's heads: the exported fp32 model on the validation samples against `stack eval`'s bars."""
    from stack.deploy.gates.accuracy import session_runner
    from stack.deploy.gates.quality import head_quality

    source = f"{len(spec.accuracy_feeds)} validation samples, fp32 model on ONNX Runtime"
    if spec.quality_evaluator is None:
        return head_quality(None, source)
    log(f"quality gate: scoring the fp32 model on {len(spec.accuracy_feeds)} validation samples against "
        f"`stack eval`'s bars ...")
    return head_quality(spec.quality_evaluator(session_runner(fp32_path)), source)


def _finish_quality(heads: dict, result: dict, allow_below_bar: bool, log) -> None:
    """Both parts of the quality gate into gate.json; its failures fail the deploy unless allowed below the bar."""
    from stack.deploy.gates.quality import driving_quality, quality_verdict

    quality = quality_verdict(heads, driving_quality(result.get("closed_loop")))
    result["quality"], result["allow_below_bar"] = quality, allow_below_bar
    result["below_bar"] = quality["reasons"] if allow_below_bar else []
    if not allow_below_bar:
        result["failures"] += quality["reasons"]
    elif quality["reasons"]:
        log("below the quality bar (--allow-below-bar): the bundle is built for experiments, NOT FOR DEPLOYMENT")


def _lineage(spec: DeploySpec, log) -> dict:
    """gate.json's lineage: the dataset the bundle was calibrated and gated on, the one its checkpoint trained on,
    and the MLflow run of that checkpoint; warns (stack.lineage) when the two datasets differ."""
    from stack.checkpoint.model_file import read_lineage
    from stack.lineage import DATASET_KEY, TRACKING_KEY, data_warning, dataset_fingerprint

    if not spec.checkpoint or not Path(spec.checkpoint).is_file():
        return {}
    seen = read_lineage(spec.checkpoint)
    given = dataset_fingerprint(spec.data_root) if spec.data_root else None
    message = data_warning(seen[DATASET_KEY], given, spec.checkpoint, spec.data_root, "calibrated and gated on")
    if message:
        log(message)
    trained_on = {k: seen[DATASET_KEY][k] for k in ("root", "hash")} if seen[DATASET_KEY] else None
    return {DATASET_KEY: given, "trained_on": trained_on, TRACKING_KEY: seen[TRACKING_KEY]}


def _attach(result: dict, spec: DeploySpec, name: str, bundle: Path, log) -> None:
    """The deploy's verdict, figures, gate.json and report.md into the MLflow run of its checkpoint, if tracked."""
    from stack.lineage import attach_to_run

    fps = result.get("fps") or {}
    metrics = {f"deploy/{name}/passed": float(result["passed"]),
               f"deploy/{name}/for_deployment": float(bool(result.get("for_deployment")))}
    metrics.update({f"deploy/{name}/{key}": value for key, value in fps.items()
                    if key in ("median_ms", "p99_ms", "fps", "budget_ms") and isinstance(value, (int, float))})
    attach_to_run(result.get("tracking"), metrics,
                  [(bundle / "gate.json", f"deploy/{name}"), (bundle / "report.md", f"deploy/{name}")],
                  {f"stack.deploy.{name}": _verdict_tag(result)}, log, chosen=spec.chosen_store,
                  checkpoint_folder=Path(spec.checkpoint).parent if spec.checkpoint else None)


def _verdict_tag(result: dict) -> str:
    """The deploy verdict as `stack runs` lists it: PASS, FAIL, or PASS-NOT-FOR-DEPLOYMENT (below the quality bar)."""
    if not result["passed"]:
        return "FAIL"
    return "PASS" if result.get("for_deployment") else "PASS-NOT-FOR-DEPLOYMENT"


def _export_step(spec: DeploySpec, folder: Path, cfg, result: dict, log) -> Path:
    log(f"exporting ONNX (opset {cfg.opset}) ...")
    exported = export_onnx(spec.net, spec.example, spec.output_names, folder / "model.onnx", cfg.opset, spec.metadata)
    reference = spec.net if spec.reference is None else spec.reference
    parity = check_parity(reference, exported.path, spec.accuracy_feeds[:2], spec.output_names, cfg.parity_atol,
                          cfg.parity_rtol)
    result["export"] = {"ops": exported.ops, "tensorrt_problems": exported.tensorrt_problems,
                        "parity": [dict(vars(row), passed=row.passed) for row in parity]}
    for row in parity:
        log(f"  parity {row.output}: max |ORT - torch| {row.max_abs_error:.2e} (tolerance {row.tolerance:.2e})")
        if not row.passed:
            result["failures"].append(f"ONNX Runtime differs from PyTorch on {row.output}: {row.max_abs_error:.2e} "
                                      f"> {row.tolerance:.2e}")
    return exported.path


def _quantize_step(spec: DeploySpec, folder: Path, fp32_path: Path, target_name: str, target, cfg, result: dict,
                   log) -> Path:
    if target.precision not in ("int8", "best"):
        result["accuracy"] = None
        return fp32_path
    check_calibration_set(spec.calibration, cfg.calibration_samples)
    cache = folder / f"calibration.{target.qdq_flavour}.json"
    cache.unlink(missing_ok=True)  # ranges belong to this export; never reuse another run's
    work = folder / "attempts"
    counter = iter(range(10 ** 6))

    def quantize_with(excluded: list) -> Path:
        path = work / f"attempt{next(counter)}.onnx"
        return quantize(fp32_path, path, target.qdq_flavour, spec.calibration, cache, cfg.keep_fp32, excluded).path

    log(f"quantizing ({target.qdq_flavour} QDQ, {len(spec.calibration)} calibration samples) and scoring "
        f"{len(spec.accuracy_feeds)} validation samples per head ...")
    candidates = quantizable_nodes(onnx.load(str(fp32_path)), cfg.keep_fp32, target.qdq_flavour)
    # TensorRT-flavoured graphs are compiled by TensorRT, not run by this host: score their INT8 as simulated.
    ranking = [_concrete(spec, f) for f in spec.sensitivity_feeds or spec.calibration[:cfg.sensitivity_samples]]
    report = acc.accuracy_gate(fp32_path, quantize_with, spec.evaluator, spec.budgets, candidates,
                               ranking[:cfg.sensitivity_samples], cfg.max_fp32_layers, log,
                               simulate_int8=target.qdq_flavour == "tensorrt")
    final = folder / "model.int8.onnx"
    shutil.copyfile(report.quantized_path, final)
    shutil.rmtree(work, ignore_errors=True)
    result["accuracy"] = report.to_dict()
    result["accuracy"]["samples"] = spec.sample_ids
    kept = fp32_nodes(onnx.load(str(fp32_path), load_external_data=False), cfg.keep_fp32)
    result["accuracy"]["keep_fp32"] = {"patterns": list(cfg.keep_fp32), "nodes": len(kept)}
    if cfg.keep_fp32 and not kept:
        log(f"warning: no node name contains any of export.keep_fp32 {list(cfg.keep_fp32)}; nothing is pinned to fp32")
    if not report.passed:
        reasons = [_accuracy_reason(h, target_name) for h in report.final.heads if not h.counts]
        if _may_ship_fp32(target):
            log("INT8 fails the accuracy gate: fp32 will ship (" + "; ".join(reasons) + ")")
        else:
            result["failures"] += reasons
    return final


def _accuracy_reason(head, target_name: str) -> str:
    """Why a head fails the accuracy gate: over budget, below its prior's bar, or not sure enough to ship."""
    if head.drop > head.budget:
        return f"accuracy: {head.head} {head.metric} drops {head.drop:+.4f} > budget {head.budget:g}"
    if head.loses_prior:
        return (f"accuracy: {head.head} {head.metric} {head.quantized:.4f} in INT8 no longer beats its prior's bar "
                f"{head.prior_bar:.4f} (fp32 {head.fp32:.4f})")
    why = (f"about {head.units_needed} {head.unit} would tell a drop of the budget's size from none: score more "
           f"validation scenes (export.accuracy_samples; data.world.scenes, val_fraction)"
           if head.units_needed > head.units else
           f"{head.units} {head.unit} are enough to tell a drop of the budget's size from none, and this drop lies "
           f"near the budget: keep more layers in fp32 (export.max_fp32_layers, export.keep_fp32)")
    return (f"accuracy: {head.head} {head.metric} drops {head.drop:+.4f}, within the budget {head.budget:g}, but its "
            f"90% interval [{head.low:+.4f}, {head.high:+.4f}] over {head.units} {head.unit} reaches past it "
            f"(inconclusive); {why}; or accept it with targets.{target_name}.accuracy_inconclusive_passes=true")


def _closed_loop_step(spec: DeploySpec, engine_onnx: Path, fp32_path: Path, target, result: dict, log) -> None:
    """fp32, INT8 and the blind policies drive the same held-out episodes; INT8 may not drive worse than fp32 by
    more than the target's budget (the quality gate judges fp32 against the blind policies from the same drive).

    Runs when the target has closed-loop episodes. INT8 drives when it passed the accuracy gate (otherwise it
    does not ship or the deploy already failed). An INT8 failure fails the deploy, or on `best` targets ships fp32."""
    budget = target.closed_loop
    if spec.closed_loop is None or budget.episodes <= 0:
        result["closed_loop"] = None
        return
    quantized = engine_onnx != fp32_path
    int8 = engine_onnx if quantized and (result.get("accuracy") or {}).get("passed", False) else None
    drivers = "INT8, fp32" if int8 else "fp32"
    log(f"closed-loop gate: {drivers} and the blind policies drive {budget.episodes} held-out episodes ...")
    gate = spec.closed_loop(int8, fp32_path, budget, target.latency_budget_ms(), log)
    result["closed_loop"] = gate
    if quantized and not int8:
        gate["int8_skipped"] = "INT8 fails the accuracy gate, so it is not driven"
    if gate["passed"] is not False:
        return
    if _may_ship_fp32(target):
        log("INT8 fails the closed-loop gate: fp32 will ship (" + "; ".join(gate["reasons"]) + ")")
    else:
        result["failures"] += gate["reasons"]


def _may_ship_fp32(target) -> bool:
    """ONNX Runtime targets with precision `best` choose between INT8 and fp32 (`_choose_shipped`)."""
    return target.runtime == "onnxruntime" and target.precision == "best"


def _speed_step(spec, folder: Path, engine_onnx: Path, fp32_path: Path, name: str, target, cfg, result: dict, log):
    from stack.deploy import tensorrt

    if target.runtime == "onnxruntime":
        _measure_onnxruntime(spec, folder, engine_onnx, fp32_path, target, cfg, result, log)
        return _finish_speed(result)
    quantized = engine_onnx != fp32_path
    result["shipped"] = {"file": engine_onnx.name, "precision": "int8" if quantized else target.precision,
                         "why": (f"TensorRT builds this QDQ graph: INT8 where Q/DQ sit, FP16 elsewhere, fp32 for "
                                 f"export.keep_fp32 (target precision {target.precision})") if quantized
                         else f"target precision {target.precision}: TensorRT builds the float graph"}
    fp32 = tensorrt.fp32_layers(onnx.load(str(engine_onnx), load_external_data=False), cfg.keep_fp32)
    result["shipped"]["fp32_layers"] = len(fp32)
    if tensorrt.available():
        _measure_tensorrt(spec, folder, engine_onnx, target, cfg, result, log, fp32)
    else:
        _predict(folder, engine_onnx, target, cfg, result, log)
    if target.runtime == "tensorrt":
        script = folder / "build_engine.sh"
        script.write_text(tensorrt.build_engine_script(engine_onnx.name, target, name, fp32))
        script.chmod(0o755)
    _finish_speed(result)


def _finish_speed(result: dict) -> None:
    if not result["fps"]["passed"]:
        result["failures"] += result["fps"]["reasons"]


def _measure_onnxruntime(spec, folder, engine_onnx, fp32_path, target, cfg, result, log):
    from stack.deploy.ort_profile import profile_nodes

    feeds = _concrete(spec, spec.accuracy_feeds[0])
    paths = [engine_onnx] + ([fp32_path] if engine_onnx != fp32_path else [])
    log(f"timing {' and '.join(p.name for p in paths)} with ONNX Runtime, side by side ({cfg.timing_runs} runs "
        f"each after {cfg.timing_warmup} warm-up) ...")
    times, reference = _time_side_by_side(paths, feeds, cfg, target)
    result["shipped"] = _choose_shipped(target, engine_onnx, fp32_path, result, times)
    shipped = folder / result["shipped"]["file"]
    log(f"shipping {shipped.name}: {result['shipped']['why']}")
    gate = measured_gate(target, times[shipped.name], "ONNX Runtime CPU", reference)
    nodes = profile_nodes(shipped, feeds)
    result["fps"] = gate.to_dict()
    result["speed"] = {"side_by_side": {name: stats.to_dict() for name, stats in times.items()},
                       "reference_workload_ms": reference,
                       "breakdown": [(n, op, ms, "measured") for n, op, ms in nodes[:40]]}
    plot_latency(folder, [(n, op, ms, op) for n, op, ms in nodes], f"measured per-node time, ONNX Runtime ({shipped.name})")


def _concrete(spec: DeploySpec, feeds: dict) -> dict:
    """`feeds` with the memory the PyTorch reference made (export.with_reference_memory), for a stateful graph."""
    from stack.deploy.export import with_reference_memory

    return with_reference_memory(feeds, spec.reference, spec.example)


def _time_side_by_side(paths: list, feeds: dict, cfg, target) -> tuple[dict, float]:
    """({file name: LatencyStats}, reference workload ms now), the models and the reference interleaved, with
    more rounds while a model's verdict on `target` is inconclusive."""
    from functools import partial

    from stack.deploy.gates.fps import TIMING_SPINS, conclusive, time_side_by_side
    from stack.deploy.runtime import gate_reference, ort_session

    sessions = {path.name: ort_session(path, spinning=TIMING_SPINS) for path in paths}
    return time_side_by_side(sessions, feeds, cfg.timing_runs, cfg.timing_warmup, gate_reference(target),
                             settled=partial(conclusive, target))


def _choose_shipped(target, int8_path: Path, fp32_path: Path, result: dict, times: dict) -> dict:
    """gate.json's `shipped`: the model file the bundle's runtime loads by default, its precision and why.

    `best` on ONNX Runtime ships the faster (median, timed side by side) of INT8 and fp32 among those that pass
    the accuracy gate: INT8 is not free on every CPU (without VNNI its convolutions widen to 16 bits and ran
    slower than fp32 on an AVX2 EPYC: docs/results/deploy.md, "INT8 on the tiny recipe")."""
    if int8_path == fp32_path:
        return {"file": fp32_path.name, "precision": "fp32", "why": f"target precision {target.precision}: no INT8"}
    int8_ms, fp32_ms = times[int8_path.name].median_ms, times[fp32_path.name].median_ms
    timing = f"INT8 median {int8_ms:.2f} ms vs fp32 {fp32_ms:.2f} ms, timed side by side"
    if not _may_ship_fp32(target):
        return {"file": int8_path.name, "precision": "int8", "why": f"target precision {target.precision} ({timing})"}
    accuracy = result.get("accuracy") or {}
    if not accuracy.get("passed", False):
        return {"file": fp32_path.name, "precision": "fp32",
                "why": f"INT8 fails the accuracy gate (see Accuracy), fp32 passes by definition ({timing})"}
    if (result.get("closed_loop") or {}).get("passed") is False:
        return {"file": fp32_path.name, "precision": "fp32",
                "why": f"INT8 fails the closed-loop gate: it drives worse than fp32 beyond the budget, or no longer "
                       f"beats a blind policy fp32 beats (see Closed loop) ({timing})"}
    if int8_ms < fp32_ms:
        return {"file": int8_path.name, "precision": "int8",
                "why": f"INT8 passes the accuracy gate and is {fp32_ms / int8_ms:.2f}x faster ({timing})"}
    return {"file": fp32_path.name, "precision": "fp32",
            "why": f"INT8 passes the accuracy gate but is not faster on this CPU: {int8_ms / fp32_ms:.2f}x fp32's "
                   f"latency ({timing})"}


def _measure_tensorrt(spec, folder, engine_onnx, target, cfg, result, log, fp32: list):
    """Build, compare and time the engine here; the timing gates the target only on the target's own device."""
    from stack.deploy import tensorrt

    device = tensorrt.device_identity()
    on_target, why_not = tensorrt.runs_on_target(target, device)
    try:
        engine = tensorrt.build_engine(engine_onnx, folder / "model.engine", target, folder / "timing.cache", log, fp32)
    except RuntimeError as exc:  # a graph TensorRT rejects fails the gate; the report says why
        result["failures"].append(f"TensorRT engine build: {exc}")
        _predict(folder, engine_onnx, target, cfg, result, log)
        return
    feeds = [_concrete(spec, f) for f in spec.accuracy_feeds[:4]]
    matches = tensorrt.compare_with_onnxruntime(engine, engine_onnx, feeds, atol=1e-2, rtol=1e-2)
    stats = tensorrt.time_engine(engine, feeds[0], cfg.timing_runs, cfg.timing_warmup)
    if not matches:
        result["failures"].append("TensorRT engine outputs differ from ONNX Runtime (polygraphy comparator)")
    timing = {"side_by_side": {engine.name: stats.to_dict()}, "engine_matches_onnxruntime": matches,
              "device": device.describe()}
    if on_target:
        result["fps"] = measured_gate(target, stats, f"TensorRT (CUDA events) on {device.describe()}", None).to_dict()
        result["speed"] = timing
        return
    elsewhere = (f"measured on {device.describe()}, not {target.description or 'the target'} ({why_not}): "
                 f"median {stats.median_ms:.2f} ms, p99 {stats.p99_ms:.2f} ms there, kept as information")
    log(f"{elsewhere}; the gate uses the prediction for the target")
    _predict(folder, engine_onnx, target, cfg, result, log)
    result["fps"]["how"] += f"; {elsewhere}"
    result["measured_elsewhere"] = dict(timing, note=elsewhere, why_not=why_not)


def _predict(folder, engine_onnx, target, cfg, result, log):
    from stack.deploy.latency.margins import (class_shares, loo_summary, target_margin, unpinned_factor,
                                              validation_note, with_unpinned)
    from stack.deploy.latency.roofline import DEFAULT_EFFICIENCY, Workload, predict

    prediction = predict(onnx.load(str(engine_onnx)), target, keep_fp32=tuple(cfg.keep_fp32))
    workload = Workload(prediction, target)
    factor = unpinned_factor(workload, DEFAULT_EFFICIENCY)
    note = (f"{PREDICTION_ERROR_NOTE}: {loo_summary()}; {validation_note(result['target'])}"
            + ("; the DLA is not modelled: this is the GPU-only latency" if target.dla_core >= 0 else ""))
    gate = predicted_gate(target, prediction, note, with_unpinned(target_margin(result["target"]), factor))
    log(f"predicted {prediction.total_ms:.2f} ms on {target.description} (no TensorRT timing on the target here)")
    result["fps"] = gate.to_dict()
    rows = [(l.name, "+".join(l.ops), l.time_ms, f"{l.precision}/{l.bound}") for l in prediction.layers]
    result["speed"] = {"prediction": prediction.to_dict(), "breakdown": sorted(rows, key=lambda r: -r[2])[:40],
                       "classes": class_shares(workload, DEFAULT_EFFICIENCY), "unpinned_factor": factor}
    points = [(l.flops / l.bytes if l.bytes else 0.0, l.flops / l.time_ms / 1e6, l.precision) for l in prediction.layers]
    peaks = {"INT8": target.int8_tops, "FP16": target.fp16_tflops, "FP32": target.fp32_tflops}
    plot_latency(folder, [(r[0], r[1], r[2], r[3].split("/")[0]) for r in rows],
                 f"predicted per-layer latency on {target.description}", (points, peaks, target.memory_bandwidth_gbs))


PREDICTION_ERROR_NOTE = ("per-class efficiencies fitted to published Jetson AGX Orin TensorRT timings (MLPerf ResNet-50 "
                         "and BERT-Large, Ultralytics YOLO11 n-x, CUDA-BEVFusion camera backbone, BEVDet's BEV pool; "
                         "docs/results/deploy.md, \"The latency model\")")
