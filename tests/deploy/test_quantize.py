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
