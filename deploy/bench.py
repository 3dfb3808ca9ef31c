"""`stack bench infer`, `latency` and `fps-bar`: the deploy stage's side-by-side measurements.

infer: the trained network (`{train.out_dir}/model.pt`) on ONNX Runtime CPU, fp32 vs INT8
in both QDQ flavours (U8S8 for the CPU, S8S8 as TensorRT wants), timed in interleaved
rounds in one process (so drift hits all alike), each with its per-head accuracy on the
same validation samples. Floor: the graph's FLOPs over this machine's fp32 matmul rate
(a dense fp32 matmul, timed in the same run).

fps-bar: a measured target's median bar derived on this machine (`ci-cpu`'s rule: sqrt(2) x the network's
fp32 median, so the network and a 2x slower one sit a factor 1.41 on either side of it), and how the target's
present bar judges both, timed side by side with the reference workload exactly as `stack deploy` times them.

latency: the latency model's fit to the published Jetson Orin references, each one's leave-one-out
error, the per-class efficiencies, the spread and the gate margin it gives, and the predicted
latency of this pipeline's network on every TensorRT target.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from stack.benchrecord import figures_of

ROUNDS = 5


def infer(pipeline, args) -> int:
    from stack.checkpoint.model_file import check_same_network, load_model_checkpoint
    from stack.deploy.gates.head_scores import make_evaluator
    from stack.deploy.latency.roofline import predict
    from stack.deploy.exportable import batch_feeds, export_network
    from stack.deploy.gates.accuracy import as_scores, session_runner
    from stack.deploy.calibration import Calibration, check_samples
    from stack.deploy.export import export_onnx
    from stack.deploy.quantize import quantize
    from stack.deploy.runtime import REFERENCE_MATMUL, matmul_ms, ort_session
    from stack.deploy.validation import calibration_and_accuracy

    checkpoint = Path(pipeline.train.out_dir) / "model.pt"
    stored, state_dict, _ = load_model_checkpoint(checkpoint)
    check_same_network(stored, pipeline, checkpoint)
    calibration, accuracy, source = calibration_and_accuracy(pipeline)
    cameras = Calibration.from_batch(accuracy[0], 0, [c.name for c in pipeline.data.rig.cameras], "the data's")
    check_samples(calibration + accuracy, cameras, f"samples ({source})")  # one calibration, baked below
    network = export_network(pipeline, state_dict, cameras)
    calibration_feeds = [f for b in calibration for f in batch_feeds(b)]
    feeds = batch_feeds(accuracy[0])[0]
    evaluate = make_evaluator(pipeline, accuracy)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        fp32 = export_onnx(network.net, network.example, network.output_names, folder / "fp32.onnx",
                           pipeline.export.opset, network.metadata).path
        models = {"fp32": fp32}
        for flavour, label in (("onnxruntime-cpu", "int8 U8S8 (cpu flavour)"), ("tensorrt", "int8 S8S8 (tensorrt flavour)")):
            models[label] = quantize(fp32, folder / f"{flavour}.onnx", flavour, calibration_feeds,
                                     folder / f"{flavour}.json", pipeline.export.keep_fp32).path
        print(f"# stack bench infer: {pipeline.name}, ONNX Runtime CPU, {source}")
        metrics = {name: as_scores(evaluate(session_runner(path))).metrics for name, path in models.items()}
        times = _interleaved({name: ort_session(path) for name, path in models.items()}, feeds, pipeline.export)
        reference = matmul_ms()
        gflop = predict(onnx.load(str(fp32)), _any_gpu_target(pipeline)).total_flops / 1e9
    rate = 2 * REFERENCE_MATMUL ** 3 / reference / 1e6  # GFLOP/s of the fp32 reference matmul
    _print_infer(metrics, times, gflop, rate, reference)
    figures = figures_of(args)
    for name, row in times.items():  # the fp32 graph's FLOPs at the reference matmul's rate bound the fp32 model
        figures.add(f"{name}: median per round", row["round_medians_ms"], "ms",
                    floor=gflop / rate * 1e3 if name == "fp32" else None)
    return 0


def _interleaved(sessions: dict, feeds: dict, cfg) -> dict:
    """Median and p99 per model, timed in ROUNDS alternating rounds after a warm-up of each."""
    import numpy as np

    from stack.deploy.runtime import time_session

    for session in sessions.values():
        time_session(session, feeds, runs=1, warmup=cfg.timing_warmup)
    samples = {name: [] for name in sessions}
    per_round = max(1, cfg.timing_runs // ROUNDS)
    for _ in range(ROUNDS):
        for name, session in sessions.items():
            stats = time_session(session, feeds, runs=per_round, warmup=1)
            samples[name].append(stats)
    out = {}
    for name, rounds in samples.items():
        medians = [s.median_ms for s in rounds]
        out[name] = {"median_ms": float(np.median(medians)), "p99_ms": float(max(s.p99_ms for s in rounds)),
                     "runs": per_round * ROUNDS, "round_medians_ms": medians}
    return out


def _any_gpu_target(pipeline):
    return next(t for t in pipeline.targets.values() if t.runtime == "tensorrt" and t.fp16_tflops > 0)


def _print_infer(metrics: dict, times: dict, gflop: float, rate_gflops: float, reference_ms: float) -> None:
    base = times["fp32"]["median_ms"]
    floor_ms = gflop / rate_gflops * 1e3
    keys = list(next(iter(metrics.values())))
    print(f"graph: {gflop:.2f} GFLOP; reference fp32 matmul {reference_ms:.2f} ms = {rate_gflops:.0f} GFLOP/s; "
          f"fp32 floor {floor_ms:.1f} ms")
    print("| model | median ms | p99 ms | speed-up vs fp32 | " + " | ".join(keys) + " |")
    print("|---|---|---|---|" + "---|" * len(keys))
    for name, row in times.items():
        values = " | ".join(f"{metrics[name][k]:.4f}" for k in keys)
        print(f"| {name} | {row['median_ms']:.1f} | {row['p99_ms']:.1f} | {base / row['median_ms']:.2f}x | {values} |")


def latency(pipeline, args) -> int:
    from stack.deploy.latency.margins import LOO_ERRORS
    from stack.deploy.latency.roofline import P99_OVER_MEDIAN
    from stack.deploy.latency.efficiency_fit import table
    from stack.deploy.latency.references import FITTED

    result = table(pipeline.targets, log=lambda message: print(f"# {message}", flush=True))
    print(f"\n# latency model fitted to {result['references']} published AGX Orin references (refs not on "
          f"AGX Orin are predicted, never fitted)")
    sources = list(dict.fromkeys(row["source"] for row in result["rows"]))
    print("| reference | family | precision | device | published ms | predicted ms | error | leave-one-out | "
          "leave-one-family-out | own device (harness refit) | source |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        cells = ["-" if row[k] is None else f"{row[k]:+.1%}" for k in ("loo_error", "lofo_error", "device_error")]
        print(f"| {row['reference']} | {row['family']} | {row['precision']} | {row['target']} | {row['published_ms']} | "
              f"{row['predicted_ms']} | {row['error']:+.1%} | {' | '.join(cells)} | [{sources.index(row['source']) + 1}] |")
    print("\n" + "\n".join(f"[{i}] {source}" for i, source in enumerate(sources, 1)))
    _latency_breakdown(result)
    eff = result["efficiency"]
    print(f"\nefficiencies (fitted: {', '.join(FITTED)}; others are priors): {eff}")
    print(f"harness overhead (per image, fitted): {result['overhead_ms']}")
    print(f"leave-one-out spread: {result['loo_min']:+.1%} to {result['loo_max']:+.1%}, RMS {result['loo_rms']:.1%}; "
          f"predicted p99 = median x margin x {P99_OVER_MEDIAN:g}")
    print("\n| target | margin | status | basis |\n|---|---|---|---|")
    for name, margin in result["margins"].items():
        print(f"| {'(no references)' if name == '*' else name} | {margin.value:g} | {margin.status} | {margin.basis} |")
    stale = {k: v for k, v in result["loo"].items() if abs(LOO_ERRORS.get(k, 99) - v) > 0.005}
    if stale:
        print(f"NOTE: latency.margins.LOO_ERRORS differs from this fit for {sorted(stale)}: update it")
    figures = figures_of(args)
    figures.add("leave-one-out error, RMS", [result["loo_rms"]], "fraction")
    _latency_predictions(pipeline, figures)
    return 0


def _latency_breakdown(result: dict) -> None:
    """Predicted ms per operator class for every AGX Orin reference: what each error is made of."""
    kinds = sorted({k for row in result["rows"] for k in row["by_kind_ms"]})
    print("\n| reference (AGX Orin) | precision | " + " | ".join(f"{k} ms" for k in kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for row in result["rows"]:
        if row["target"] == "orin":
            print(f"| {row['reference']} | {row['precision']} | "
                  + " | ".join(f"{row['by_kind_ms'].get(k, 0.0):.3f}" for k in kinds) + " |")


def _latency_predictions(pipeline, figures) -> None:
    from stack.deploy.export import export_onnx
    from stack.deploy.latency.margins import target_margin
    from stack.deploy.latency.roofline import P99_OVER_MEDIAN, predict
    from stack.deploy.exportable import export_network
    from stack.models import build_model

    network = export_network(pipeline, build_model(pipeline).state_dict())
    with tempfile.TemporaryDirectory() as folder:
        path = export_onnx(network.net, network.example, network.output_names, Path(folder) / "m.onnx",
                           pipeline.export.opset, network.metadata).path
        model = onnx.load(str(path))
    print(f"\n{pipeline.name} network, fp16 everywhere vs all convs/matmuls INT8 (predicted, not measured; "
          f"gated as INT8 x the target's margin, p99 x {P99_OVER_MEDIAN:g} more):")
    print("| target | fp16 ms | int8 ms | margin | int8 x margin ms | bar FPS | p99 bar ms | status |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, target in sorted(pipeline.targets.items()):
        if target.runtime != "tensorrt":
            continue
        fp16 = predict(model, target, keep_fp32=tuple(pipeline.export.keep_fp32)).total_ms
        int8 = predict(model, target, keep_fp32=tuple(pipeline.export.keep_fp32), all_int8=True).total_ms
        margin = target_margin(name)
        figures.add(f"{name}: predicted fp16", [fp16], "ms")
        figures.add(f"{name}: predicted int8", [int8], "ms")
        print(f"| {name} | {fp16:.2f} | {int8:.2f} | {margin.value:g} | {int8 * margin.value:.2f} | {target.min_fps:g} | "
              f"{target.max_p99_latency_ms:g} | {margin.status} |")


FPS_BAR_TARGET = "ci-cpu"
FPS_BAR_REPEATS = 3


def fps_bar(pipeline, args) -> int:
    """`stack bench fps-bar`: ci-cpu's median bar and reference workload derived on this machine.

    The pipeline's fp32 network (untrained weights: a dense fp32 graph costs the same whatever its values) and
    the same graph run twice per frame are timed side by side as deploy times them (`time_side_by_side`, no
    spinning, a reference run after every model run), FPS_BAR_REPEATS times in fresh sessions: once against
    the target's present reference (its present verdicts) and once against the network's own frozen graph,
    written to the bench history folder. On the machine a bar is set for normalisation is the identity: L is the
    network's raw median, `reference_workload_ms` the frozen graph's paired time."""
    import math

    import numpy as np

    from stack.benchrecord.records import DEFAULT_HISTORY
    from stack.config import load_target
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network
    from stack.deploy.gates.fps import TIMING_SPINS, time_side_by_side
    from stack.deploy.reference_graph import example_feeds, freeze, thaw
    from stack.deploy.runtime import RepeatedSession, gate_reference, ort_session
    from stack.models import build_model

    target, cfg = load_target(FPS_BAR_TARGET, pipeline), pipeline.export
    network = export_network(pipeline, build_model(pipeline).state_dict())
    feeds = {name: value.numpy() for name, value in network.example.items()}
    frozen_path = Path(DEFAULT_HISTORY) / f"fps-bar-{pipeline.name}.reference.onnx.gz"
    with tempfile.TemporaryDirectory() as folder:
        path = export_onnx(network.net, network.example, network.output_names, Path(folder) / "fp32.onnx",
                           cfg.opset, network.metadata).path
        freeze(path, frozen_path)
        print(f"# stack bench fps-bar: {pipeline.name} fp32 and the same graph run twice, side by side as deploy "
              f"times them ({cfg.timing_runs} runs each in rounds), {FPS_BAR_REPEATS} times")
        frozen = thaw(frozen_path)
        medians, references = [], []
        for repeat in range(FPS_BAR_REPEATS):
            session = ort_session(path, spinning=TIMING_SPINS)
            sessions = {"network": session, "twice": RepeatedSession(session, 2)}
            present = _present_verdicts(target, time_side_by_side(sessions, feeds, cfg.timing_runs, cfg.timing_warmup,
                                                                  gate_reference(target)))
            own = (ort_session(frozen, spinning=TIMING_SPINS), example_feeds(frozen))
            times, reference = time_side_by_side(sessions, feeds, cfg.timing_runs, cfg.timing_warmup, own)
            medians.append(times["network"].median_ms)
            references.append(reference)
            print(f"repeat {repeat + 1}: network {times['network'].median_ms:.2f} ms, twice "
                  f"{times['twice'].median_ms:.2f} ms ({times['twice'].median_ms / times['network'].median_ms:.2f}x), "
                  f"its frozen graph {reference:.2f} ms paired; {present}")
    level, reference_ms = float(np.median(medians)), float(np.median(references))
    bar_ms = math.sqrt(2) * level
    print(f"derived here: L = {level:.2f} ms (median of {FPS_BAR_REPEATS}), bar sqrt(2) x L = {bar_ms:.2f} ms -> "
          f"min_fps {1000.0 / bar_ms:.1f}; reference_workload_ms {reference_ms:.2f} with reference_graph "
          f"{frozen_path} (copy it into configs/targets/ to adopt the bar)")
    figures = figures_of(args)
    figures.add("fp32 network median", medians, "ms")
    figures.add("its frozen graph, paired", references, "ms")
    return 0


def _present_verdicts(target, timed) -> str:
    """How the target's present bar judges the network and its twice-slower copy."""
    from stack.deploy.gates.fps import measured_gate

    times, reference = timed
    gates = {name: measured_gate(target, stats, "ONNX Runtime CPU", reference) for name, stats in times.items()}
    return (f"{FPS_BAR_TARGET}'s present bar {1000.0 / target.min_fps:.2f} ms: network {gates['network'].verdict} "
            f"({gates['network'].median_ms:.2f} ms normalised), twice {gates['twice'].verdict} "
            f"({gates['twice'].median_ms:.2f} ms normalised; reference {reference:.2f} ms now vs "
            f"{target.reference_workload_ms:g} ms)")
