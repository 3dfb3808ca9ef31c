"""Published Jetson Orin timings the latency model is fitted to and checked against.

Each reference names the network (rebuilt with random weights by `stack.deploy.latency.networks`:
latency does not depend on the weights' values), its input, the precision of the published
engine, the published latency, the device (a target in configs/targets) and its source.

`PRIOR` is the efficiency the fit starts from and `FITTED` the classes it may set
(`stack.deploy.latency.efficiency_fit`). References on other devices (Orin Nano Super, Orin NX) are never
fitted: they check that the AGX Orin efficiencies carry over to another target's peaks. BERT-Large (MLPerf
BERT-99) is the one reference whose time is mostly matmul: it pins that class; BEVDet-TensorRT's BEV pool (BEVPoolv2)
the one that is a gather from an L2-resident table: it pins the gather class. CUDA-PointPillars on AGX Orin
is held out of the fit (`Reference.fitted`): a test family the model never sees. Fitted, it pulls FP16
conv towards its own TensorRT 8.4 / JetPack 5 engine (the FP16 YOLO11 figures are TensorRT 10 / JetPack 6):
YOLO11's FP16 rows then err by up to +59% with their family left out, and ResNet-50's leave-one-out by +25%.
"""

from __future__ import annotations

from dataclasses import dataclass

from stack.deploy.latency.roofline import Efficiency

FIT_TARGET = "orin"


@dataclass(frozen=True)
class Reference:
    name: str
    family: str
    builder: str
    """`stack.deploy.latency.networks.build_network` or `networks.GRAPHS` name."""
    input_shape: tuple
    precision: str
    """`int8` (INT8 engine, FP16 fallback), `fp16`, or `fp32` (an FP32 CUDA kernel)."""
    latency_ms: float
    source: str
    target: str = FIT_TARGET
    """The configs/targets entry of the device it was measured on."""
    harness: str = "engine"
    """What the published time includes besides the engine: `engine` (nothing: trtexec, LoadGen, C++
    timers around enqueue+sync) or `ultralytics-python` (the Python predictor's per-image call,
    binding and synchronisation overhead, fitted as one constant per harness)."""
    fitted: bool = True
    """False: a held-out reference of the fit device, never fitted; the full fit predicts it, so its error is
    a leave-one-family-out error by construction (a family the model never saw), and it counts in the margins
    as one."""


MLPERF = ("MLPerf Inference v3.1 Edge, closed division, NVIDIA Jetson AGX Orin 64G, NVIDIA's TensorRT submission "
          "(GPU; software stack in the submission's system description), ResNet-50 SingleStream 90th-percentile "
          "latency; https://mlcommons.org/benchmarks/inference-edge/")
MLPERF_BERT = ("MLPerf Inference v3.1, closed division, NVIDIA Orin_TRT (Jetson AGX Orin 64G, JetPack 5.1.1, "
               "TensorRT 8.5.2: closed/NVIDIA/systems/Orin_TRT.json), BERT-99 (INT8) SingleStream, "
               "mlcommons/inference_results_v3.1 closed/NVIDIA/results/Orin_TRT/bert-99/SingleStream/performance/run_1/"
               "mlperf_log_summary.txt: p90 5.705 ms, p97 6.387, p99 6.487, p99.9 6.495, max 6.546. SingleStream "
               "publishes percentiles over SQuAD windows of every length (the engine drops the padding: 'Variable "
               "Sequence Lengths' in NVIDIA's BERT README, mlcommons/inference_results_v4.0 closed/NVIDIA/code/bert/"
               "tensorrt/README.md); the latency plateaus from p97 to the max, the windows filled to all 384 tokens, "
               "so the p99 is BERT-Large at 384 tokens; https://github.com/mlcommons/inference_results_v3.1")
BEVDET = ("LCH1238/bevdet-tensorrt-cpp README 'Inference Speed' (commit 023c677), 'BEV pool' column, 'Jetson AGX "
          "Orin FP16' row: 0.571 ms for one frame (the 'FP32' row: 0.620 ms); both engines run the same FP32 BEVPoolv2 "
          "kernel (src/bevpool.cu) between them, timed by the host clock around its launch and cudaDeviceSynchronize "
          "(src/bevdet.cpp DoInfer). JetPack 5.1.1, CUDA 11.4, TensorRT 8.5.2.2, MAXN (the author, issue #2). Geometry "
          "cfgs/bevdet_lt_depth.yaml, calibration sample0/sample0000.yaml: 356,761 points into 13,360 of 128 x 128 "
          "cells, 80 channels; https://github.com/LCH1238/bevdet-tensorrt-cpp")
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
    Reference("CUDA-PointPillars (OpenPCDet KITTI) 40000 pillars x 32 points", "PointPillars lidar detector",
              "pointpillars", (1, 40000, 32, 10), "fp16", 9.12,
              "NVIDIA-AI-IOT/CUDA-PointPillars README, 'Performance in FP16' table, 'Inference' row (the TensorRT "
              "engine alone; voxelization, feature generation and post-processing are separate rows), Jetson AGX "
              "Orin, JetPack 5.0, CUDA 11.4, TensorRT 8.4.0, nvpmodel -m 0 + jetson_clocks; "
              "https://github.com/NVIDIA-AI-IOT/CUDA-PointPillars", fitted=False),
    Reference("BERT-Large + SQuAD span head, 384 tokens", "BERT encoder", "bert_large", (1, 384), "int8", 6.49,
              MLPERF_BERT),
    Reference("BEVDet-TensorRT BEV pool (BEVPoolv2) 356761 points x 80 channels", "BEV pooling", "bevdet_bev_pool",
              (6, 118, 16, 44, 80), "fp32", 0.571, BEVDET),
) + _yolo_references()
"""BEVDet's BEV pool uses the FP16 row's 0.571 ms: the kernel is FP32 in both rows, and the FP16 row is the engine a
car runs (an FP16/INT8 image stage before it, as ours); the FP32 row's 0.620 ms (+8.6%) is the figure's spread."""

PRIOR = Efficiency(conv_int8=0.5, conv_fp16=0.5, dwconv=0.05, matmul=0.3, memory=0.7, gather=1.0, gather_dram=0.25,
                   launch_us=4.0)
"""Before fitting: dense tensor-core convs at batch 1 reach about half of peak, streaming kernels about
70% of DRAM bandwidth, rows gathered from an L2-resident table at the DRAM peak (neither L2's speed nor a gather's
loss assumed), rows gathered from DRAM at a quarter of it, each kernel costs a few microseconds; the classes no
reference pins keep these."""
FITTED = ("conv_int8", "conv_fp16", "memory", "matmul", "gather")
"""The efficiencies the AGX Orin references determine. Matmul only through BERT-Large (87% of its predicted time
at the prior; under 0.5% of any other reference's), so a fit without BERT keeps matmul at its prior
(`efficiency_fit.identified`) and BERT's leave-one-out error is the prior's. Gather likewise only through BEVDet's BEV
pool (its whole time; no other reference gathers from an L2-resident table). Grouped conv and DRAM gathers (BERT's
word embeddings) are a few per cent of any reference's time and keep their priors. The published AGX Orin timings of
depthwise-separable networks cannot pin `dwconv` either (MLPerf Inference v2.0 SSD-MobileNet, NetsPresso's
MobileNetV3): their depthwise layers are memory-bound in the roofline, so halving `dwconv` moves them by at most 2%;
it sets the time of grouped convs with several channels per group (RegNet, ResNeXt: our regnetx_002 backbone), and no
AGX Orin timing of one was found (docs/log/2026-11-28_grouped-convs-not-pinned.md). The per-kernel launch is collinear
with the Ultralytics harness's per-image overhead (only ResNet-50 separates them), so it keeps its prior too."""
BOUNDS: dict = {"gather": (0.1, 10.0)}
"""Fit bounds by field; efficiencies default to (0.02, 1). Gather is a multiple of DRAM bandwidth: L2 is faster."""


def references_for(target_name: str) -> list[Reference]:
    """The published references measured on `target_name` (empty: the target has none of its own)."""
    return [r for r in REFERENCES if r.target == target_name]
