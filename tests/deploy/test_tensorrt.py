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
    assert script.startswith("#!/usr/bin/env bash") and "median >= 12 FPS and p99 <= 83 ms" in script


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
