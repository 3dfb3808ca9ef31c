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
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np

from stack.deploy.runtime import LatencyStats, summarize

TRTEXEC_WARMUP_MS = 500
TRTEXEC_ITERATIONS = 1000


def trtexec_command(onnx_name: str, engine_name: str, target, timing_cache: str = "timing.cache") -> str:
    """The exact trtexec line that builds and times the engine for `target` on the device."""
    args = ["trtexec", f"--onnx={onnx_name}", f"--saveEngine={engine_name}", f"--timingCacheFile={timing_cache}"]
    if target.precision in ("fp16", "best", "int8"):
        args.append("--fp16")
    if target.precision in ("int8", "best"):
        args.append("--int8")  # explicit quantization: the Q/DQ nodes set the INT8 layers
    if target.dla_core >= 0:
        args += [f"--useDLACore={target.dla_core}", "--allowGPUFallback"]
    args += [f"--warmUp={TRTEXEC_WARMUP_MS}", f"--iterations={TRTEXEC_ITERATIONS}", "--useCudaGraph",
             "--percentile=50,99", "--separateProfileRun", "--dumpProfile", "--exportProfile=profile.json"]
    return " ".join(shlex.quote(a) for a in args)


def build_engine_script(onnx_name: str, target, target_name: str) -> str:
    """`build_engine.sh`: build + time on the device, with the gate's bar printed next to the result."""
    command = trtexec_command(onnx_name, f"{target_name}.engine", target)
    return f"""#!/usr/bin/env bash
# Build and time the {target_name} engine on the device ({target.description}).
# Run from this bundle folder on the target; needs trtexec (JetPack: /usr/src/tensorrt/bin/trtexec).
# The gate: median >= {target.min_fps:g} FPS and p99 <= {target.max_p99_latency_ms:g} ms (see report.md).
set -euo pipefail
cd "$(dirname "$0")"
export PATH="$PATH:/usr/src/tensorrt/bin"
{command} | tee trtexec.log
grep -E "GPU Compute Time|Throughput" trtexec.log
"""


def build_engine(onnx_path: Path, engine_path: Path, target, timing_cache: Path, log=print) -> Path:
    """Build a serialized engine from the QDQ ONNX with TensorRT's Python API (needs TensorRT)."""
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


def available() -> bool:
    """True when TensorRT can be imported and a CUDA device is usable."""
    from stack.testing import trt_skip_reason

    return trt_skip_reason() is None
