"""QDQ flavour properties per target, read off the quantized graph, and calibration errors."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from stack.deploy.quantize import CalibrationError, check_calibration_set, quantize, quantized_layers, weight_layers
from stack.deploy.trt_ops import tensorrt_problems

from deploy_fixture_net import make_samples


def _qdq(model):
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return [(n, constants) for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")], constants


@pytest.fixture(scope="module")
def quantized(fixture_onnx, tmp_path_factory):
    path, _ = fixture_onnx
    folder = tmp_path_factory.mktemp("qdq")
    samples = make_samples(8)
    return {flavour: onnx.load(str(quantize(path, folder / f"{flavour}.onnx", flavour, samples,
                                            folder / f"{flavour}.calib.json", keep_fp32=["bev_pool"]).path))
            for flavour in ("tensorrt", "onnxruntime-cpu")}


def test_tensorrt_flavour_is_symmetric_s8_with_per_channel_weights_and_float_bias(quantized):
    model = quantized["tensorrt"]
    nodes, constants = _qdq(model)
    assert nodes
    for node, _ in nodes:
        zero = constants[node.input[2]]
        assert zero.dtype == np.int8 and not zero.any(), node.name  # every zero point 0, signed
    weights_dq = [n for n, _ in nodes if n.op_type == "DequantizeLinear" and constants.get(n.input[0]) is not None
                  and constants[n.input[0]].ndim == 4]
    assert weights_dq
    for node in weights_dq:
        scale = constants[node.input[1]]
        axis = {a.name: a.i for a in node.attribute}.get("axis", 1)
        assert scale.ndim == 1 and scale.size == constants[node.input[0]].shape[0] and axis == 0, node.name
    convs = [n for n in model.graph.node if n.op_type == "Conv" and len(n.input) > 2]
    assert convs and all(constants[n.input[2]].dtype == np.float32 for n in convs)  # biases stay float
    assert tensorrt_problems(model) == []


def _activation_qdq_consumers(model):
    """(node, input index) pairs where a node reads an activation through a Q/DQ pair."""
    producers = {out: node for node in model.graph.node for out in node.output}
    constants = {i.name for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for index, name in enumerate(node.input):
            dq = producers.get(name)
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] not in constants:
                found.append((node, index))
    return found


def test_tensorrt_flavour_places_qdq_on_weighted_layers_and_residual_adds_only(quantized):
    """TensorRT's Q/DQ placement guidance: inputs of Conv/ConvTranspose/MatMul/Gemm and both inputs of residual Adds."""
    model = quantized["tensorrt"]
    constants = {i.name for i in model.graph.initializer}
    consumers = _activation_qdq_consumers(model)
    kinds = {node.op_type for node, _ in consumers}
    assert kinds <= {"Conv", "ConvTranspose", "MatMul", "Gemm", "Add"}, kinds
    assert {"Conv", "Add"} <= kinds
    for node, _ in consumers:
        if node.op_type == "Add":  # a residual join: both inputs are activations, both quantized
            assert not set(node.input) & constants
            assert sum(1 for n, _ in consumers if n is node) == 2, node.name
    # every weighted layer outside the kept-fp32 pooling reads a quantized activation
    weighted = [n for n in model.graph.node if n.op_type in ("Conv", "Gemm") and "bev_pool" not in n.name]
    assert weighted and all(any(n is node for node, _ in consumers) for n in weighted)
    # the onnxruntime-cpu flavour quantizes around other operators too (what ONNX Runtime's kernels want)
    assert {n.op_type for n, _ in _activation_qdq_consumers(quantized["onnxruntime-cpu"])} - \
        {"Conv", "ConvTranspose", "MatMul", "Gemm", "Add"}


def test_onnxruntime_cpu_flavour_is_u8_activations_s8_weights(quantized):
    nodes, constants = _qdq(quantized["onnxruntime-cpu"])
    activations = [constants[n.input[2]] for n, _ in nodes if n.op_type == "QuantizeLinear"]
    weights = [constants[n.input[2]] for n, _ in nodes if n.op_type == "DequantizeLinear"
               and constants.get(n.input[0]) is not None and constants[n.input[0]].ndim == 4]
    assert activations and all(z.dtype == np.uint8 for z in activations)
    assert any(z.any() for z in activations)  # asymmetric: nonzero zero points exist
    assert weights and all(z.dtype == np.int8 and not z.any() for z in weights)
    assert any("nonzero zero point" in p for p in tensorrt_problems(quantized["onnxruntime-cpu"]))


def test_bev_pooling_stays_fp32(quantized, fixture_onnx):
    fp32 = onnx.load(str(fixture_onnx[0]))
    bev = [n.name for n in fp32.graph.node if "bev_pool" in n.name and n.op_type == "MatMul"]
    assert bev
    for model in quantized.values():
        layers = quantized_layers(model)
        assert not set(bev) & set(layers)
        assert set(layers) == set(weight_layers(fp32)) - set(bev)


def test_calibration_set_too_small():
    with pytest.raises(CalibrationError, match="calibration set too small.*asks for 32.*found 3"):
        check_calibration_set(make_samples(3), 32)
    check_calibration_set(make_samples(4), 4)


def test_unknown_flavour_is_bad_input(fixture_onnx, tmp_path):
    from stack.errors import StackError

    with pytest.raises(StackError, match="QDQ flavour 'none' cannot quantize"):
        quantize(fixture_onnx[0], tmp_path / "q.onnx", "none", make_samples(2), tmp_path / "c.json")


def test_simulated_int8_is_the_exact_quantized_arithmetic(tmp_path):
    """A TensorRT-flavoured QDQ MatMul scored with simulate_int8 equals fake-quant math in numpy, on any host.

    The values are the worst case for x86 int8 kernels without VNNI (full-scale activations times
    full-scale weights saturate their 16-bit pair sums); the simulation must not depend on that."""
    from onnx import TensorProto, helper, numpy_helper

    from stack.deploy.runtime import ort_session

    rng = np.random.default_rng(0)
    k, n = 64, 16
    weights = np.where(rng.random((k, n)) < 0.5, -127, 127).astype(np.int8)
    x_scale, w_scale = np.float32(0.05), np.float32(0.01)
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "xs", "zp"], ["xq"]),
         helper.make_node("DequantizeLinear", ["xq", "xs", "zp"], ["xd"]),
         helper.make_node("DequantizeLinear", ["w", "ws", "zp"], ["wd"]),
         helper.make_node("MatMul", ["xd", "wd"], ["y"])],
        "qdq_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(np.array(x_scale), "xs"),
         numpy_helper.from_array(np.array(w_scale), "ws"), numpy_helper.from_array(np.array(0, np.int8), "zp")])
    path = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = (rng.random((4, k)) * 8.0 - 1.0).astype(np.float32)  # mostly beyond +127 steps: clipped
    expected = (np.clip(np.round(x / x_scale), -128, 127) * x_scale) @ (weights.astype(np.float32) * w_scale)
    got = ort_session(path, threads=1, simulate_int8=True).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
