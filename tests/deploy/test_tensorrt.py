"""The TensorRT layer: the trtexec line everywhere; engine build, comparison and timing where TensorRT runs."""

import dataclasses

import pytest

from stack.config import load_pipeline, load_target
from stack.deploy import tensorrt

from deploy_fixture_net import make_samples


@pytest.fixture(scope="module")
def orin():
    return load_target("orin", load_pipeline())


def test_trtexec_line_uses_explicit_quantization_with_fp16_fallback(orin):
    line = tensorrt.trtexec_command("model.int8.onnx", "orin.engine", orin)
    assert line.startswith("trtexec --onnx=model.int8.onnx --saveEngine=orin.engine --timingCacheFile=timing.cache")
    assert "--int8" in line and "--fp16" in line and "--useDLACore" not in line
    assert "--percentile=50,99" in line


def test_trtexec_line_for_a_dla_core_allows_gpu_fallback(orin):
    line = tensorrt.trtexec_command("m.onnx", "e.engine", dataclasses.replace(orin, dla_core=1))
    assert "--useDLACore=1 --allowGPUFallback" in line


def test_fp16_target_builds_without_int8(orin):
    line = tensorrt.trtexec_command("m.onnx", "e.engine", dataclasses.replace(orin, precision="fp16"))
    assert "--fp16" in line and "--int8" not in line


def test_build_script_states_the_bar(orin):
    script = tensorrt.build_engine_script("model.int8.onnx", orin, "orin")
    assert script.startswith("#!/usr/bin/env bash")
    assert f"median >= {orin.min_fps:g} FPS and p99 <= {orin.max_p99_latency_ms:g} ms" in script


def test_build_script_keeps_a_hostile_description_in_its_comment(orin, tmp_path):
    import subprocess

    marker = tmp_path / "pwned"
    hostile = dataclasses.replace(orin, description=f"Orin\ntouch {marker}\r; $(touch {marker}) `touch {marker}`")
    script = tmp_path / "build_engine.sh"
    script.write_text(tensorrt.build_engine_script("model.int8.onnx", hostile, "orin", ["/a b/Conv", "x;y"]))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    commands = [line for line in script.read_text().splitlines() if line and not line.startswith("#")]
    assert not any("touch" in line for line in commands), commands
    # run it with a trtexec that only records its arguments: the layer names arrive as single arguments
    (tmp_path / "trtexec").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > args.txt\necho "GPU Compute Time: 1 ms"\n')
    (tmp_path / "trtexec").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    assert subprocess.run(["bash", str(script)], env=env, capture_output=True).returncode == 0
    assert not marker.exists()
    args = (tmp_path / "args.txt").read_text().splitlines()
    assert "--layerPrecisions=/a b/Conv:fp32,x;y:fp32" in args and "--precisionConstraints=obey" in args
    assert "--saveEngine=device/orin.engine" in args and (tmp_path / "device" / "trtexec.log").is_file()


def test_fp32_layers_are_what_the_accuracy_gate_scored_in_fp32(fixture_onnx, tmp_path, orin):
    import onnx

    from stack.deploy.quantize import quantize, weight_layers

    model = onnx.load(str(fixture_onnx[0]))
    excluded = weight_layers(model)[1]  # as if the accuracy gate had kept this layer in fp32
    qdq = onnx.load(str(quantize(fixture_onnx[0], tmp_path / "q.onnx", "tensorrt", make_samples(8), tmp_path / "c.json",
                                 keep_fp32=["bev_pool"], exclude=[excluded]).path))
    layers = tensorrt.fp32_layers(qdq, ["bev_pool"])
    assert excluded in layers and any("bev_pool" in name for name in layers)
    assert weight_layers(model)[0] not in layers  # quantized layers are free to run in INT8
    line = tensorrt.trtexec_command("q.onnx", "e.engine", orin, fp32=layers)
    assert "--precisionConstraints=obey" in line and f"{excluded}:fp32" in line and "--layerOutputTypes=" in line


class _FakeLayer:
    def __init__(self, name):
        self.name, self.num_outputs, self.precision, self.output_types = name, 2, None, {}

    def set_output_type(self, index, dtype):
        self.output_types[index] = dtype


class _FakeNetwork:
    def __init__(self, names):
        self.layers = [_FakeLayer(n) for n in names]
        self.num_layers = len(self.layers)

    def get_layer(self, index):
        return self.layers[index]


def test_engine_build_constrains_exactly_the_kept_layers():
    """The TensorRT API side of the constraint, on a stand-in network object (TensorRT is not installable here)."""
    fake_trt = type("trt", (), {"float32": "float32"})
    network = _FakeNetwork(["/net/Conv", "/net/Conv_1", "/net/bev_pool/MatMul", "/net/Relu"])
    assert tensorrt.constrain_fp32(network, ["/net/Conv", "/net/bev_pool/MatMul"], fake_trt) == 2
    constrained = {layer.name for layer in network.layers if layer.precision == "float32"}
    assert constrained == {"/net/Conv", "/net/bev_pool/MatMul"}  # /net/Conv_1 is a sibling, not a part
    assert all(layer.output_types == {0: "float32", 1: "float32"} for layer in network.layers
               if layer.name in constrained)


ORIN_AGX = tensorrt.DeviceIdentity("Orin", "8.7", 16, "NVIDIA Jetson AGX Orin Developer Kit")
H100 = tensorrt.DeviceIdentity("NVIDIA H100 80GB HBM3", "9.0", 132)
ORIN_NANO = tensorrt.DeviceIdentity("Orin", "8.7", 8, "NVIDIA Jetson Orin Nano Developer Kit")


def test_a_timing_counts_only_on_the_targets_device(orin):
    assert tensorrt.runs_on_target(orin, ORIN_AGX) == (True, "")
    on, why = tensorrt.runs_on_target(orin, H100)
    assert not on and "compute capability 9.0" in why
    on, why = tensorrt.runs_on_target(orin, ORIN_NANO)
    assert not on and "8 SMs" in why
    assert not tensorrt.runs_on_target(dataclasses.replace(orin, device_compute_capability=""), ORIN_AGX)[0]


@pytest.mark.parametrize("device", [H100, ORIN_AGX], ids=["h100", "agx-orin"])
def test_orin_gate_on_another_gpu_uses_the_prediction(tmp_path, monkeypatch, orin, device):
    """TensorRT importable on an x86 H100: its timing is information, the Orin gate is predicted."""
    import numpy as np

    from stack.deploy.gates.accuracy import HeadBudget
    from stack.deploy.orchestrate import DeploySpec, run_deploy
    from stack.deploy.runtime import summarize

    from deploy_fixture_net import example_inputs, make_net

    def fake_build(onnx_path, engine_path, target, cache, log=print, fp32=()):
        engine_path.write_bytes(b"engine")
        return engine_path

    monkeypatch.setattr(tensorrt, "available", lambda: True)
    monkeypatch.setattr(tensorrt, "device_identity", lambda: device)
    monkeypatch.setattr(tensorrt, "build_engine", fake_build)
    monkeypatch.setattr(tensorrt, "compare_with_onnxruntime", lambda *a, **k: True)
    monkeypatch.setattr(tensorrt, "time_engine", lambda *a, **k: summarize([0.0005] * 30))
    feeds = make_samples(12, seed=3)
    spec = DeploySpec(make_net(), example_inputs(), ["segmentation", "speed"], {"pipeline_hash": "t"}, feeds[:8],
                      feeds[8:], lambda run: {"m": float(np.mean(run(feeds[8])["segmentation"] ** 0))},
                      [HeadBudget("segmentation", "m", 1.0, False)], "fixture", "f.pt", "f", "t")
    pipeline = load_pipeline(["configs/pipeline.yaml"], ["export.calibration_samples=8", "export.keep_fp32=[bev_pool]"])
    result = run_deploy(spec, "orin", orin, pipeline.export, tmp_path / "orin", log=lambda m: None)
    report = (tmp_path / "orin" / "report.md").read_text()
    if device is H100:
        assert result["fps"]["mode"] == "predicted"
        assert "measured on NVIDIA H100 80GB HBM3" in result["fps"]["how"] and "not Jetson AGX Orin" in result["fps"]["how"]
        assert result["measured_elsewhere"]["side_by_side"]["model.engine"]["median_ms"] == pytest.approx(0.5)
        assert "measured on NVIDIA H100" in report
    else:
        assert result["fps"]["mode"] == "measured" and "on Orin" in result["fps"]["how"]
        assert "measured_elsewhere" not in result


@pytest.mark.trt
def test_engine_matches_onnxruntime_and_is_timed(fixture_onnx, tmp_path, orin):
    from stack.deploy.quantize import quantize

    qdq = quantize(fixture_onnx[0], tmp_path / "q.onnx", "tensorrt", make_samples(8), tmp_path / "c.json",
                   keep_fp32=["bev_pool"]).path
    engine = tensorrt.build_engine(qdq, tmp_path / "e.engine", orin, tmp_path / "timing.cache", log=lambda m: None)
    assert engine.stat().st_size > 0 and (tmp_path / "timing.cache").stat().st_size > 0
    assert tensorrt.compare_with_onnxruntime(engine, qdq, make_samples(2, seed=7), atol=5e-2, rtol=5e-2)
    stats = tensorrt.time_engine(engine, make_samples(1)[0], runs=50, warmup=10)
    assert stats.runs == 50 and 0 < stats.median_ms <= stats.p99_ms
