"""TensorRT engines from the QDQ ONNX: build, compare against ONNX Runtime, and time.

This layer is deliberately thin, because TensorRT exists only on GPU hosts and Jetsons
(`pip install stack[trt]`, or JetPack's python3-libnvinfer): everything is imported
lazily, and on a machine without TensorRT the bundle instead carries `build_engine.sh`
with the exact `trtexec` line (`trtexec_command`) to run on the device.

- Build (`build_engine`): explicit quantization, i.e. the Q/DQ nodes decide what runs in
  INT8 (no calibrator); FP16 enabled as the fallback for everything else (`best`), a
  timing cache reused across builds, and optionally a DLA core with GPU fallback.
  The BEV pooling's nodes are left unquantized by the QDQ model, so TensorRT runs them in
  FP16/FP32. Built with the TensorRT 10 API (`create_network(0)`, explicit batch).
- Compare (`compare_with_onnxruntime`): polygraphy's `Comparator` runs the engine and
  ONNX Runtime on the same inputs and checks every output against tolerances.
- Time (`time_engine`): warm-up, then per-run CUDA-event timing of `execute_async_v3`,
  reported as median and p99.
- Which device (`device_identity`, `runs_on_target`): a timing is the target's measurement
  only on the target's own GPU (compute capability, multiprocessor count, name pattern from
  the target's YAML). An engine timed on an H100 says nothing about an Orin's 83 ms budget;
  there the figure is kept as information and the gate uses the prediction.
- What the accuracy gate scored is what TensorRT builds (`fp32_layers`): the layers kept in
  fp32 (`export.keep_fp32` and the gate's own fallbacks) get precision constraints
  (`layer.precision`, output types, `OBEY_PRECISION_CONSTRAINTS`; trtexec's
  `--layerPrecisions`/`--layerOutputTypes`/`--precisionConstraints=obey`), so `best` cannot
  quietly run them in FP16.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stack.deploy.bundle import DEVICE_FOLDER
from stack.deploy.runtime import LatencyStats, summarize

TRTEXEC_WARMUP_MS = 500
TRTEXEC_ITERATIONS = 1000


@dataclass(frozen=True)
class DeviceIdentity:
    """The CUDA device a TensorRT timing was taken on."""

    name: str
    compute_capability: str
    multiprocessors: int
    board: str = ""
    """/proc/device-tree/model on a Jetson ("NVIDIA Jetson AGX Orin Developer Kit"), else empty."""

    def describe(self) -> str:
        board = f", {self.board}" if self.board else ""
        return f"{self.name} (compute capability {self.compute_capability}, {self.multiprocessors} SMs{board})"


def device_identity() -> DeviceIdentity:
    """Identity of CUDA device 0 (needs a GPU)."""
    import torch

    props = torch.cuda.get_device_properties(0)
    model = Path("/proc/device-tree/model")
    board = model.read_bytes().decode(errors="replace").strip("\x00\n ") if model.is_file() else ""
    return DeviceIdentity(props.name, f"{props.major}.{props.minor}", props.multi_processor_count, board)


def runs_on_target(target, device: DeviceIdentity) -> tuple[bool, str]:
    """(does a timing on `device` measure `target`?, why not when it does not)."""
    if not target.device_compute_capability:
        return False, "the target names no device (targets.T.device_compute_capability)"
    if device.compute_capability != target.device_compute_capability:
        return False, (f"compute capability {device.compute_capability} is not the target's "
                       f"{target.device_compute_capability}")
    if target.device_multiprocessors and device.multiprocessors != target.device_multiprocessors:
        return False, f"{device.multiprocessors} SMs, the target has {target.device_multiprocessors}"
    if target.device_name_pattern and not re.search(target.device_name_pattern, f"{device.name} | {device.board}"):
        return False, f"the device does not match the target's name pattern {target.device_name_pattern!r}"
    return True, ""


def fp32_layers(model, keep_fp32) -> list[str]:
    """ONNX node names TensorRT must build in fp32: those `keep_fp32` names and weighted layers left unquantized.

    A weighted layer (Conv, ConvTranspose, MatMul, Gemm) without a DequantizeLinear on its weight
    was kept in fp32 by the accuracy gate (or by keep_fp32), which scored it in fp32; under
    `best` TensorRT would otherwise be free to run it in FP16. Constant nodes carry no compute.
    """
    from stack.deploy.quantize import fp32_nodes, quantized_layers, weight_layers

    names = set(fp32_nodes(model, keep_fp32)) | (set(weight_layers(model)) - set(quantized_layers(model)))
    constants = {n.name for n in model.graph.node if n.op_type == "Constant"}
    return [n.name for n in model.graph.node if n.name in names - constants]


def trtexec_command(onnx_name: str, engine_name: str, target, timing_cache: str = "timing.cache",
                    fp32: list[str] = (), profile: str = "profile.json") -> str:
    """The exact trtexec line that builds and times the engine for `target` on the device."""
    args = ["trtexec", f"--onnx={onnx_name}", f"--saveEngine={engine_name}", f"--timingCacheFile={timing_cache}"]
    if target.precision in ("fp16", "best", "int8"):
        args.append("--fp16")
    if target.precision in ("int8", "best"):
        args.append("--int8")  # explicit quantization: the Q/DQ nodes set the INT8 layers
    if fp32 and target.precision != "fp32":
        spec = ",".join(f"{name}:fp32" for name in fp32)
        args += ["--precisionConstraints=obey", f"--layerPrecisions={spec}", f"--layerOutputTypes={spec}"]
    if target.dla_core >= 0:
        args += [f"--useDLACore={target.dla_core}", "--allowGPUFallback"]
    args += [f"--warmUp={TRTEXEC_WARMUP_MS}", f"--iterations={TRTEXEC_ITERATIONS}", "--useCudaGraph",
             "--percentile=50,99", "--separateProfileRun", "--dumpProfile", f"--exportProfile={profile}"]
    return " ".join(shlex.quote(a) for a in args)


def _comment(text: str) -> str:
    """`text` made safe for one shell comment line: control characters (a newline would end the comment) become spaces."""
    return re.sub(r"[\x00-\x1f\x7f]", " ", str(text))


def build_engine_script(onnx_name: str, target, target_name: str, fp32: list[str] = ()) -> str:
    """`build_engine.sh`: build + time on the device, with the gate's bar printed next to the result."""
    out = DEVICE_FOLDER
    command = trtexec_command(onnx_name, f"{out}/{target_name}.engine", target, f"{out}/timing.cache", fp32,
                              f"{out}/profile.json")
    return f"""#!/usr/bin/env bash
# Build and time the {_comment(target_name)} engine on the device ({_comment(target.description)}).
# Run from this bundle folder on the target; needs trtexec (JetPack: /usr/src/tensorrt/bin/trtexec).
# Everything it writes goes to {out}/, which the bundle's checksums leave out (stack.deploy.bundle).
# The gate: median >= {target.min_fps:g} FPS and p99 <= {target.max_p99_latency_ms:g} ms (see report.md).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p {out}
export PATH="$PATH:/usr/src/tensorrt/bin"
{command} | tee {out}/trtexec.log
grep -E "GPU Compute Time|Throughput" {out}/trtexec.log
"""


def build_engine(onnx_path: Path, engine_path: Path, target, timing_cache: Path, log=print,
                 fp32: list[str] = ()) -> Path:
    """Build a serialized engine from the QDQ ONNX with TensorRT's Python API (needs TensorRT).

    `fp32`: ONNX node names whose layers are constrained to fp32 (`fp32_layers`).
    """
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if target.precision in ("fp16", "best", "int8"):
        config.set_flag(trt.BuilderFlag.FP16)
    if target.precision in ("int8", "best"):
        config.set_flag(trt.BuilderFlag.INT8)
    if fp32 and target.precision != "fp32":
        constrained = constrain_fp32(network, fp32, trt)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        log(f"  {constrained} layers constrained to fp32 ({len(fp32)} ONNX nodes kept fp32 by the accuracy gate)")
    if target.dla_core >= 0:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = target.dla_core
        config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    log(f"building TensorRT {trt.__version__} engine from {onnx_path.name} ({target.precision})")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}; see the log above")
    engine_path.write_bytes(bytes(serialized))
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return engine_path


def constrain_fp32(network, fp32: list[str], trt) -> int:
    """Set fp32 precision and output types on every layer named after a node in `fp32`; returns how many.

    The ONNX parser names each layer after its node; exact names only, because exported graphs
    hold siblings such as `/x/Conv` and `/x/Conv_1` that a prefix rule would confuse.
    """
    names = set(fp32)
    count = 0
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if layer.name in names:
            layer.precision = trt.float32
            for output in range(layer.num_outputs):
                layer.set_output_type(output, trt.float32)
            count += 1
    return count


def compare_with_onnxruntime(engine_path: Path, onnx_path: Path, feeds: list[dict], atol: float, rtol: float) -> bool:
    """polygraphy Comparator: the engine vs ONNX Runtime on the same feeds; True when every output matches."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, CompareFunc

    runners = [TrtRunner(EngineFromBytes(BytesFromPath(str(engine_path)))),
               OnnxrtRunner(SessionFromOnnx(str(onnx_path)))]
    results = Comparator.run(runners, data_loader=feeds)
    return bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=atol, rtol=rtol)))


def time_engine(engine_path: Path, feeds: dict, runs: int, warmup: int) -> LatencyStats:
    """Median and p99 of the engine's GPU time per run, by CUDA events, after `warmup` runs."""
    import tensorrt as trt
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
    context = engine.create_execution_context()
    stream = torch.cuda.Stream()
    buffers = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        shape = tuple(engine.get_tensor_shape(name))
        dtype = torch.from_numpy(np.zeros(1, dtype=trt.nptype(engine.get_tensor_dtype(name)))).dtype
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            buffers[name] = torch.as_tensor(feeds[name]).to("cuda", dtype)
        else:
            buffers[name] = torch.empty(shape, dtype=dtype, device="cuda")
        context.set_tensor_address(name, buffers[name].data_ptr())
    times = []
    for index in range(warmup + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        context.execute_async_v3(stream.cuda_stream)
        end.record(stream)
        end.synchronize()
        if index >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return summarize(times)


def unavailable_reason() -> str | None:
    """Why TensorRT cannot run here, or None when it can be imported and a CUDA device is usable."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return "needs TensorRT (pip extra `stack[trt]` on a GPU host or a Jetson); not importable here"
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA GPU; torch.cuda.is_available() is False here"


def available() -> bool:
    return unavailable_reason() is None
