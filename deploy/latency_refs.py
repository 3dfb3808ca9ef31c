"""Published Jetson Orin timings the latency model is fitted to and checked against.

Each reference names the network (rebuilt with random weights by `stack.deploy.latency_nets`:
latency does not depend on the weights' values), its input, the precision of the published
engine, the published latency, the device (a target in configs/targets) and its source.

`fit` sets the efficiencies the AGX Orin references can pin (dense conv INT8 and FP16, memory
bandwidth; plus the per-image overhead of the Ultralytics harness) by least squares on
log(predicted / published), with a soft-L1 loss so one odd reference cannot drag the rest; the
classes too small in every reference to be identified (depthwise conv, matmul, gather) keep their
priors (`PRIOR`, `FITTED`). `leave_one_out`
refits without each reference and predicts it: that error, not the in-sample one, is the model's
stated error, and its worst optimistic value sets the gate margin (`latency.gate_margin`).
References on other devices (Orin Nano Super, Orin NX) are never fitted: they check that the
AGX Orin efficiencies carry over to another target's peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from stack.deploy.latency import Efficiency, Workload, predict
from stack.deploy.latency_nets import reference_graph

FIT_TARGET = "orin"


@dataclass(frozen=True)
class Reference:
    name: str
    family: str
    builder: str
    """`stack.deploy.latency_nets.build_network` name."""
    input_shape: tuple
    precision: str
    """`int8` (INT8 engine, FP16 fallback) or `fp16`."""
    latency_ms: float
    source: str
    target: str = FIT_TARGET
    """The configs/targets entry of the device it was measured on."""
    harness: str = "engine"
    """What the published time includes besides the engine: `engine` (nothing: trtexec, LoadGen, C++
    timers around enqueue+sync) or `ultralytics-python` (the Python predictor's per-image call,
    binding and synchronisation overhead, fitted as one constant per harness)."""


MLPERF = ("MLPerf Inference v3.1 Edge, closed division, NVIDIA Jetson AGX Orin 64G, NVIDIA's TensorRT submission "
          "(GPU; software stack in the submission's system description), ResNet-50 SingleStream 90th-percentile "
          "latency; https://mlcommons.org/benchmarks/inference-edge/")
ULTRALYTICS = ("Ultralytics docs, docs/en/guides/nvidia-jetson.md (github.com/ultralytics/ultralytics, commit 75231dff), "
               "'{device}' table, TensorRT ({precision}) inference time ms/im, 640x640, batch 1, benchmarked with "
               "Ultralytics {version}, {jetpack}, MAX power mode + jetson_clocks as the guide prescribes")
YOLO_DEVICES = {
    "orin": ("NVIDIA Jetson AGX Orin Developer Kit (64GB)", "8.3.133", "JetPack 6",
             {"fp16": (2.60, 3.68, 6.79, 8.11, 13.66), "int8": (2.45, 3.01, 5.12, 6.60, 9.78)}),
    "orin-nano-super": ("NVIDIA Jetson Orin Nano Super Developer Kit", "8.3.51", "JetPack 6.1",
                        {"fp16": (4.91, 7.30, 13.99, 17.57, 32.94), "int8": (3.91, 5.25, 9.58, 12.37, 20.72)}),
    "orin-nx": ("NVIDIA Jetson Orin NX 16GB (Seeed reComputer J4012)", "8.3.51", "JetPack 6.0",
                {"fp16": (4.85, 7.55, 14.45, 18.53, 35.99), "int8": (4.37, 5.63, 10.19, 13.36, 22.32)}),
}
"""Ultralytics' published YOLO11 n/s/m/l/x TensorRT timings per device."""


def _yolo_references() -> tuple:
    out = []
    for target, (device, version, jetpack, table) in YOLO_DEVICES.items():
        for precision, timings in table.items():
            for scale, ms in zip("nsmlx", timings):
                source = ULTRALYTICS.format(device=device, precision=precision.upper(), version=version, jetpack=jetpack)
                out.append(Reference(f"YOLO11{scale} 640x640", "YOLO11 detector", f"yolo11{scale}", (1, 3, 640, 640),
                                     precision, ms, source, target, "ultralytics-python"))
    return tuple(out)


REFERENCES = (
    Reference("ResNet-50 v1.5 224x224", "ResNet classifier", "resnet50", (1, 3, 224, 224), "int8", 0.64, MLPERF),
    Reference("CUDA-BEVFusion camera backbone (R50 + LSS-FPN + depth net) 6x3x256x704", "BEV camera backbone",
              "bevfusion_camera", (6, 3, 256, 704), "int8", 12.73,
              "NVIDIA-AI-IOT/Lidar_AI_Solution issue #175: CUDA-BEVFusion resnet50int8 'Camera Backbone' on Jetson AGX "
              "Orin (JetPack 5: Python 3.8 in the same user's log, issue #168; power mode not stated), steady state "
              "12.73-14.36 ms per frame; the best value is used; https://github.com/NVIDIA-AI-IOT/Lidar_AI_Solution/issues/175"),
) + _yolo_references()

PRIOR = Efficiency(conv_int8=0.5, conv_fp16=0.5, dwconv=0.05, matmul=0.3, memory=0.7, gather=0.25, launch_us=4.0)
"""Before fitting: dense tensor-core convs at batch 1 reach about half of peak, streaming kernels about
70% of DRAM bandwidth, each kernel costs a few microseconds; the classes no reference pins keep these."""
FITTED = ("conv_int8", "conv_fp16", "memory")
"""The efficiencies the AGX Orin references determine. Depthwise conv, matmul and gather are a few per cent
of any reference's time (fitting them leaves them at the prior); the per-kernel launch is collinear with
the Ultralytics harness's per-image overhead (only ResNet-50 separates them), so it keeps its prior too."""
BOUNDS: dict = {}
"""Fit bounds by field; efficiencies default to (0.02, 1)."""


def references_for(target_name: str) -> list[Reference]:
    """The published references measured on `target_name` (empty: the target has none of its own)."""
    return [r for r in REFERENCES if r.target == target_name]


def workloads(targets: dict, references=REFERENCES, log=None) -> dict:
    """{reference: Workload on its own target}; graphs come from the latency_nets cache."""
    out = {}
    for index, ref in enumerate(references, 1):
        if log:
            log(f"[{index}/{len(references)}] {ref.name} {ref.precision} on {ref.target}")
        target = targets[ref.target]
        precise = replace(target, precision="fp16") if ref.precision == "fp16" else target
        prediction = predict(reference_graph(ref.builder, ref.input_shape, log), precise, efficiency=PRIOR,
                             all_int8=ref.precision == "int8")
        out[ref] = Workload(prediction, precise)
    return out


@dataclass(frozen=True)
class Fit:
    efficiency: Efficiency
    overhead_ms: dict
    """Per-inference time a harness adds to the engine's (`Reference.harness`), ms."""

    def predict_ms(self, load: Workload, ref: Reference) -> float:
        return load.total_ms(self.efficiency) + self.overhead_ms.get(ref.harness, 0.0)

    def error(self, load: Workload, ref: Reference) -> float:
        return self.predict_ms(load, ref) / ref.latency_ms - 1.0


OVERHEAD_BOUNDS = (0.01, 5.0)


def fit(loads: dict, prior: Efficiency = PRIOR, names: tuple = FITTED, loss: str = "soft_l1") -> Fit:
    """`prior` with `names` (and one overhead per non-engine harness) set by a least-squares fit of
    log(predicted / published) over `loads` (`loss`: scipy's; soft-L1 by default, `linear` for plain least squares)."""
    from scipy.optimize import least_squares

    refs = list(loads)
    harnesses = sorted({r.harness for r in refs} - {"engine"})
    bounds = [BOUNDS.get(n, (0.02, 1.0)) for n in names] + [OVERHEAD_BOUNDS] * len(harnesses)
    lower, upper = np.log([b[0] for b in bounds]), np.log([b[1] for b in bounds])
    start = np.clip(np.log([getattr(prior, n) for n in names] + [0.5] * len(harnesses)), lower, upper)

    def unpack(logs) -> Fit:
        values = np.exp(logs)
        return Fit(replace(prior, **{n: float(v) for n, v in zip(names, values)}),
                   {h: float(v) for h, v in zip(harnesses, values[len(names):])})

    def residuals(logs):
        model = unpack(logs)
        return [np.log(model.predict_ms(loads[r], r) / r.latency_ms) for r in refs]

    result = least_squares(residuals, start, bounds=(lower, upper), loss=loss, f_scale=0.1, diff_step=1e-3)
    model = unpack(result.x)
    return Fit(replace(model.efficiency, **{n: round(getattr(model.efficiency, n), 4) for n in names}),
               {h: round(v, 4) for h, v in model.overhead_ms.items()})


def leave_one_out(loads: dict, prior: Efficiency = PRIOR, names: tuple = FITTED, loss: str = "soft_l1") -> dict:
    """{reference: error when fitted on all the others}: the model's out-of-sample error per reference."""
    out = {}
    for ref in loads:
        others = {r: w for r, w in loads.items() if r is not ref}
        out[ref] = fit(others, prior, names, loss).error(loads[ref], ref)
    return out


def outside(errors: dict, bound: float = 0.2) -> dict:
    """The references whose relative error is beyond +-`bound` (the issue's goal for AGX Orin: 20%)."""
    return {ref: error for ref, error in errors.items() if abs(error) > bound}


def table(targets: dict, loads: dict | None = None, log=None) -> dict:
    """Everything `stack bench latency` prints: fit, per-reference rows (in-sample and LOO), spread, margin."""
    from stack.deploy.latency import gate_margin

    loads = loads if loads is not None else workloads(targets, log=log)
    own = {r: w for r, w in loads.items() if r.target == FIT_TARGET}
    fitted = fit(own)
    loo = leave_one_out(own)
    rows = []
    for ref, load in loads.items():
        rows.append({"reference": ref.name, "family": ref.family, "precision": ref.precision, "target": ref.target,
                     "published_ms": ref.latency_ms, "predicted_ms": round(fitted.predict_ms(load, ref), 3),
                     "error": round(fitted.error(load, ref), 3), "harness": ref.harness,
                     "loo_error": round(loo[ref], 3) if ref in loo else None, "source": ref.source,
                     "by_kind_ms": {k: round(v, 3) for k, v in load.share_by_kind(fitted.efficiency).items()}})
    errors = [loo[r] for r in own]
    return {"efficiency": fitted.efficiency, "overhead_ms": fitted.overhead_ms, "rows": rows,
            "loo": {r.name + " " + r.precision: round(e, 3) for r, e in loo.items()},
            "loo_min": min(errors), "loo_max": max(errors), "loo_rms": float(np.sqrt(np.mean(np.square(errors)))),
            "margin": gate_margin({r.name + " " + r.precision: e for r, e in loo.items()}), "references": len(own)}
