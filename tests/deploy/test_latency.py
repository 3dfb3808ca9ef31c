"""The latency model: FLOPs and bytes per layer, TensorRT-style fusion, precision from Q/DQ."""

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
import numpy as np

from stack.config import load_pipeline, load_target
from stack.deploy.latency import Efficiency, predict


@pytest.fixture(scope="module")
def orin():
    return load_target("orin", load_pipeline())


def _conv_graph(channels=16, size=32, residual=True):
    weight = numpy_helper.from_array(np.ones((channels, channels, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu")]
    out = "r"
    if residual:
        nodes.append(helper.make_node("Add", ["r", "x"], ["y"], name="add"))
        out = "y"
    nodes.append(helper.make_node("Reshape", [out, "shape"], ["z"], name="flat"))
    shape = numpy_helper.from_array(np.array([1, -1], np.int64), "shape")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [weight, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_conv_relu_add_fuse_into_one_kernel_with_exact_flops(orin):
    prediction = predict(_conv_graph(), orin)
    assert len(prediction.layers) == 1  # Relu and the residual Add fused, Reshape free
    layer = prediction.layers[0]
    assert layer.ops == ["Conv", "Relu", "Add"]
    assert layer.flops == 2 * 16 * 32 * 32 * 16 * 9
    elements = 16 * 32 * 32
    assert layer.bytes == (3 * elements + 16 * 16 * 9) * 2  # input, residual, output and weights in fp16
    assert layer.precision == "fp16"


def test_roofline_terms(orin):
    eff = Efficiency(compute=0.5, memory=0.5, launch_us=0.0)
    layer = predict(_conv_graph(channels=256, size=64, residual=False), orin, efficiency=eff).layers[0]
    compute_ms = layer.flops / (orin.fp16_tflops * 1e12 * 0.5) * 1e3
    memory_ms = layer.bytes / (orin.memory_bandwidth_gbs * 1e9 * 0.5) * 1e3
    assert layer.time_ms == pytest.approx(max(compute_ms, memory_ms))
    assert layer.bound == ("compute" if compute_ms > memory_ms else "memory")


def test_qdq_layers_are_int8_and_kept_nodes_fp32(fixture_onnx, tmp_path, orin):
    from deploy_fixture_net import make_samples
    from stack.deploy.quantize import quantize

    path, _ = fixture_onnx
    qdq = quantize(path, tmp_path / "q.onnx", "tensorrt", make_samples(4), tmp_path / "c.json", keep_fp32=["bev_pool"])
    prediction = predict(onnx.load(str(qdq.path)), orin, keep_fp32=("bev_pool",))
    precisions = {layer.name: layer.precision for layer in prediction.layers}
    assert precisions["/net/blocks/blocks.0/conv1/Conv"] == "int8"
    assert all(p == "fp32" for name, p in precisions.items() if "bev_pool" in name)
    fp16 = predict(onnx.load(str(path)), orin)
    assert {layer.precision for layer in fp16.layers} <= {"fp16"}
    assert prediction.total_ms > 0 and fp16.total_flops == pytest.approx(prediction.total_flops, rel=0.01)


def test_target_without_peaks_cannot_be_predicted():
    cpu = load_target("cpu", load_pipeline())
    with pytest.raises(ValueError, match="no fp16 peak"):
        predict(_conv_graph(), cpu)


@pytest.mark.slow
def test_stated_error_matches_the_published_references(orin):
    """The fit reproduces the fitted reference and the held-out error is the one the gate's margin uses."""
    from stack.deploy.latency import DEFAULT_EFFICIENCY, GATE_MARGIN, HELD_OUT_ERROR
    from stack.deploy.latency_refs import errors

    rows = {row["role"]: row for row in errors(orin, DEFAULT_EFFICIENCY)}
    assert abs(rows["fitted"]["error"]) < 0.02
    assert rows["held out"]["error"] == pytest.approx(HELD_OUT_ERROR, abs=0.02)
    assert GATE_MARGIN * (1 + HELD_OUT_ERROR) == pytest.approx(1.0, abs=0.01)


def test_pointwise_chain_is_one_kernel(orin):
    mean = numpy_helper.from_array(np.full((1, 3, 1, 1), 120.0, np.float32), "mean")
    std = numpy_helper.from_array(np.full((1, 3, 1, 1), 60.0, np.float32), "std")
    nodes = [helper.make_node("Cast", ["x"], ["f"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Sub", ["f", "mean"], ["s"], name="sub"),
             helper.make_node("Div", ["s", "std"], ["y"], name="div")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 64, 64])], [mean, std])
    layers = predict(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), orin).layers
    assert len(layers) == 1 and layers[0].ops == ["Cast", "Sub", "Div"]
    assert layers[0].bytes == 2 * 3 * 64 * 64 * 2  # one read of x, one write of y (fp16 accounting)
