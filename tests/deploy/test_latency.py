"""The latency model: FLOPs and bytes per layer, TensorRT-style fusion, precision from Q/DQ."""

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
import numpy as np

from stack.config import load_pipeline, load_target
from stack.deploy.latency.roofline import Efficiency, predict


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
    eff = Efficiency(conv_fp16=0.5, memory=0.5, launch_us=0.0)
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


def _silu_conv_graph():
    weight = numpy_helper.from_array(np.ones((8, 8, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
             helper.make_node("Mul", ["c", "s"], ["m"], name="mul"),
             helper.make_node("Concat", ["m", "x"], ["y"], name="cat", axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_silu_fuses_into_the_conv_and_concat_is_free(orin):
    """x * sigmoid(x) after a conv is one TensorRT kernel; concat elimination writes producers in place."""
    layers = predict(_silu_conv_graph(), orin).layers
    assert [layer.ops for layer in layers] == [["Conv", "Sigmoid", "Mul"]]
    assert layers[0].kind == "conv"


def _model(nodes, inputs: dict, initializers=()):
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
                              list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_attention_is_one_kernel_and_its_transposes_are_operand_layouts(orin):
    """softmax(Q K^T / 8) V then the output projection, as PyTorch exports it: the scores never leave the chip (one
    kernel reading Q, K, V and writing the context), and the K^T and head-merge Transposes cost nothing."""
    heads, tokens, dim = 4, 128, 32
    scale = numpy_helper.from_array(np.array(8.0, np.float32), "scale")
    shape = numpy_helper.from_array(np.array([1, tokens, heads * dim], np.int64), "shape")
    weight = numpy_helper.from_array(np.ones((heads * dim, heads * dim), np.float32), "w")
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Div", ["s", "scale"], ["d"], name="scale"),
             helper.make_node("Softmax", ["d"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"], name="av"),
             helper.make_node("Transpose", ["o"], ["ot"], name="merge", perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["ot", "shape"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="proj")]
    qkv = {name: [1, heads, tokens, dim] for name in "qkv"}
    layers = predict(_model(nodes, qkv, [scale, shape, weight]), orin).layers
    assert [layer.ops for layer in layers] == [["MatMul", "Div", "Softmax", "MatMul"], ["MatMul"]]
    assert layers[0].kind == "matmul" and layers[0].flops == 2 * (2 * heads * tokens * tokens * dim)
    assert layers[0].bytes == 4 * heads * tokens * dim * 2  # Q, K, V and the context in fp16; no scores


def test_gelu_fuses_into_the_matmul_before_it(orin):
    """x * 0.5 * (1 + erf(x / sqrt 2)) after a MatMul + bias (BERT's FFN as PyTorch exports it) is one kernel."""
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("b", np.ones(64)), ("root2", 1.4142135), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node(op, inputs, [out], name=name) for op, inputs, out, name in (
        ("MatMul", ["x", "w"], "m", "fc"), ("Add", ["m", "b"], "h", "bias"), ("Div", ["h", "root2"], "d", "div"),
        ("Erf", ["d"], "e", "erf"), ("Add", ["e", "one"], "a", "plus1"), ("Mul", ["h", "a"], "g", "mul"),
        ("Mul", ["g", "half"], "y", "half"))]
    weight = numpy_helper.from_array(np.ones((32, 64), np.float32), "w")
    layers = predict(_model(nodes, {"x": [1, 16, 32]}, [weight] + consts), orin).layers
    assert [layer.ops for layer in layers] == [["MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul"]]
    assert layers[0].bytes == (16 * 32 + 32 * 64 + 16 * 64) * 2  # input, weights, output; no pre-activation


def test_layers_kept_fp32_move_four_byte_elements(orin):
    """A layer kept fp32 by name reads and writes fp32 tensors in the engine, not the fp16 ones costed before."""
    fp16, kept = (predict(_conv_graph(), orin, keep_fp32=keep).layers[0] for keep in ((), ("conv",)))
    assert kept.precision == "fp32" and kept.bytes == 2 * fp16.bytes


def _gather_graph(rows: int, columns: int, indices: int):
    table = numpy_helper.from_array(np.zeros((rows, columns), np.float32), "table")
    index = numpy_helper.from_array(np.zeros(indices, np.int64), "index")
    nodes = [helper.make_node("Gather", ["table", "index"], ["g"], name="gather", axis=0),
             helper.make_node("Relu", ["g"], ["y"], name="relu")]
    return _model(nodes, {}, [table, index])


def test_a_table_in_l2_is_read_once_and_its_rows_from_l2(orin):
    """A 64 KB table (in AGX Orin's 4 MB L2): table once, indices and output from DRAM, rows at the L2 gather
    efficiency. A 16 MB one: the DRAM cost, rows and output at the DRAM-gather efficiency."""
    from stack.deploy.latency.roofline import l2_cache_bytes

    assert l2_cache_bytes(orin) == 4 << 20
    eff = Efficiency(memory=0.5, gather=2.0, gather_dram=0.25, launch_us=0.0)
    small = predict(_gather_graph(1024, 32, 4096), orin, efficiency=eff).layers[0]
    out = 4096 * 32 * 2  # fp16 rows
    assert small.kind == "gather" and small.l2_bytes == out
    assert small.bytes == 1024 * 32 * 2 + 4096 * 2 + out  # table once, indices, output written
    gbs = orin.memory_bandwidth_gbs * 1e6  # bytes per ms
    assert small.time_ms == pytest.approx(small.bytes / (gbs * 0.5) + out / (gbs * 2.0))
    twice = predict(_gather_graph(1024, 32, 8192), orin, efficiency=eff).layers[0]
    assert twice.bytes - small.bytes == 4096 * 2 + out  # more rows read: no second read of the table
    large = predict(_gather_graph(256 * 1024, 32, 4096), orin, efficiency=eff).layers[0]
    assert large.kind == "gather_dram" and large.l2_bytes == 0 and large.bytes == 2 * out  # constant indices: free
    assert large.time_ms == pytest.approx(2 * out / (gbs * 0.25)) and large.time_ms > 2 * small.time_ms


def test_bevdet_bev_pool_is_one_fused_gather_kernel(orin):
    """BEVPoolv2 as an ONNX graph (gathers, Mul, ScatterND add) is costed as the one kernel it is: both tables once
    (they fit in 4 MB), every point's depth value and feature row from L2, indices and the BEV from DRAM. The graph
    computes the pool: a segment sum of depth x feature over each cell's points."""
    from dataclasses import replace

    import onnxruntime as ort

    from stack.deploy.latency.networks import BEVDET_CELLS, BEVDET_GRID, BEVDET_POINTS, GRAPHS

    shape = (6, 118, 16, 44, 80)
    layers = predict(GRAPHS["bevdet_bev_pool"](shape), replace(orin, precision="fp32")).layers
    assert [layer.ops for layer in layers] == [["Gather", "Gather", "Mul", "ScatterND"]]
    layer, grid = layers[0], BEVDET_GRID[0] * BEVDET_GRID[1]
    assert layer.kind == "gather" and layer.precision == "fp32"
    assert layer.l2_bytes == 4 * BEVDET_POINTS * (80 + 1)
    tables = 6 * 118 * 16 * 44 + 6 * 16 * 44 * 80
    assert layer.bytes == 4 * (tables + 3 * BEVDET_POINTS + grid * 80)
    assert 13_000 < BEVDET_CELLS < BEVDET_POINTS / 20

    small = (2, 3, 2, 4, 5)
    model = GRAPHS["bevdet_bev_pool"](small, points=40, cells=7)
    rng = np.random.default_rng(1)
    depth, feat = rng.random(small[:4], np.float32), rng.random((2, 2, 4, 5), np.float32)
    bev = ort.InferenceSession(model.SerializeToString()).run(None, {"depth": depth, "feat": feat})[0]
    tables = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    expected = np.zeros((grid, 5), np.float32)
    np.add.at(expected, tables["ranks_bev"][:, 0],
              depth.reshape(-1)[tables["ranks_depth"]][:, None] * feat.reshape(-1, 5)[tables["ranks_feat"]])
    assert bev.shape == (1, *BEVDET_GRID, 5) and np.allclose(bev.reshape(grid, 5), expected, atol=1e-5)
    assert np.count_nonzero(np.abs(expected).sum(1)) == 7


def test_operator_classes(orin):
    weight = numpy_helper.from_array(np.ones((16, 1, 3, 3), np.float32), "w")
    table = numpy_helper.from_array(np.ones((64, 16), np.float32), "t")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="dw", pads=[1, 1, 1, 1], group=16),
             helper.make_node("Flatten", ["c"], ["f"], name="flat", axis=1),
             helper.make_node("Gather", ["t", "idx"], ["g"], name="gather", axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8]),
                                           helper.make_tensor_value_info("idx", TensorProto.INT64, [32])],
                              [helper.make_tensor_value_info("f", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("g", TensorProto.FLOAT, None)], [weight, table])
    layers = predict(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), orin).layers
    assert {layer.name: layer.kind for layer in layers} == {"dw": "dwconv", "gather": "gather"}


def test_only_grouped_convs_depend_on_dwconv_not_depthwise_ones(orin):
    """Why no depthwise-separable network (MobileNet, EfficientNet, SSD-MobileNet) can pin `dwconv`: a 3x3 depthwise
    conv does 9 MACs per output element, so the roofline puts it on the memory side and halving `dwconv` leaves it
    unchanged; a RegNetX-style grouped conv (8 channels per group, 72 MACs) is on the compute side and slows."""
    def grouped(width):  # 64 channels at 112 x 112, `width` input channels per group
        weight = numpy_helper.from_array(np.ones((64, width, 3, 3), np.float32), "w")
        conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1], group=64 // width)
        return _model([conv], {"x": [1, 64, 112, 112]}, [weight])

    for width, slows in ((1, False), (8, True)):
        prior, halved = (predict(grouped(width), orin, efficiency=Efficiency(dwconv=d), all_int8=True).layers[0]
                         for d in (0.05, 0.025))
        assert prior.kind == "dwconv" and prior.bound == ("compute" if slows else "memory")
        assert (halved.time_ms > prior.time_ms) == slows


def _workload(compute_ms: float, memory_ms: float = 0.0, kind: str = "conv", precision: str = "int8"):
    """A one-layer Workload with the given ideal times (what `Workload` derives from a graph)."""
    from stack.deploy.latency.roofline import Workload

    load = Workload.__new__(Workload)
    load.compute_ms, load.memory_ms, load.l2_ms = np.array([compute_ms]), np.array([memory_ms]), np.zeros(1)
    load.kinds = [(kind, precision)]
    load.classes, load.index = [(kind, precision)], np.array([0])
    return load


def test_the_margin_carries_an_unpinned_class_for_the_networks_built_of_it():
    """No published Orin timing pins grouped convs (`dwconv` keeps its prior): a network whose time sits in them is
    re-priced at a quarter of that prior and the target's margin grows by the ratio; one without them keeps its
    margin. The per-class table names what pins each class."""
    from stack.deploy.latency.margins import class_shares, target_margin, unpinned_factor, with_unpinned
    from stack.deploy.latency.roofline import FITTED_EFFICIENCY

    grouped, dense = _workload(1.0, kind="dwconv"), _workload(1.0)
    factor = unpinned_factor(grouped, FITTED_EFFICIENCY)
    assert factor > 3.0 and unpinned_factor(dense, FITTED_EFFICIENCY) == pytest.approx(1.0)
    carried = with_unpinned(target_margin("orin"), factor)
    assert carried.value == pytest.approx(target_margin("orin").value * factor, rel=1e-3) and "dwconv" in carried.basis
    assert with_unpinned(target_margin("orin"), 1.0) == target_margin("orin")
    (row,) = class_shares(grouped, FITTED_EFFICIENCY)
    assert row["class"] == "dwconv" and row["share"] == pytest.approx(1.0) and "unpinned" in row["error"]


def _ref(name: str, published: float):
    from stack.deploy.latency.references import Reference

    return Reference(name, "synthetic", "none", (1,), "int8", published, "hand-made")


def test_leave_one_out_on_a_hand_checkable_case():
    """One efficiency, three 1 ms (ideal) networks published at 2, 2 and 2.42 ms, plain least squares in log space:
    log e = mean(log(ideal / published)). Without C, e = 0.5 predicts C at 2 ms: -17.36%. Without A,
    e = sqrt(0.5 / 2.42) = 1 / 2.2 predicts A at 2.2 ms: +10%."""
    from stack.deploy.latency.efficiency_fit import fit, leave_one_out

    loads = {_ref("A", 2.0): _workload(1.0), _ref("B", 2.0): _workload(1.0), _ref("C", 2.42): _workload(1.0)}
    prior = Efficiency(conv_int8=0.9, launch_us=0.0)
    full = fit(loads, prior, names=("conv_int8",), loss="linear")
    assert full.efficiency.conv_int8 == pytest.approx((0.5 * 0.5 / 2.42) ** (1 / 3), rel=1e-3)
    errors = {ref.name: error for ref, error in leave_one_out(loads, prior, ("conv_int8",), "linear").items()}
    assert errors["C"] == pytest.approx(2.0 / 2.42 - 1, abs=1e-3)
    assert errors["A"] == pytest.approx(0.10, abs=1e-3) and errors["B"] == pytest.approx(0.10, abs=1e-3)


def test_a_class_no_reference_depends_on_keeps_its_prior():
    """A matmul that is 0.1% of the only reference's time cannot be fitted: the solver would set it to whatever
    absorbs the conv's residual; it keeps its prior, and the conv takes the whole fit."""
    from stack.deploy.latency.efficiency_fit import fit, identified
    from stack.deploy.latency.roofline import Workload

    load = Workload.__new__(Workload)
    load.compute_ms, load.memory_ms, load.l2_ms = np.array([1.0, 0.001]), np.zeros(2), np.zeros(2)
    load.kinds = load.classes = [("conv", "int8"), ("matmul", "int8")]
    load.index = np.array([0, 1])
    prior = Efficiency(conv_int8=0.5, matmul=0.3, launch_us=0.0)
    loads = {_ref("A", 2.5): load}
    assert identified(loads, prior, ("conv_int8", "matmul")) == ("conv_int8",)
    fitted = fit(loads, prior, ("conv_int8", "matmul"), loss="linear").efficiency
    assert fitted.matmul == 0.3 and fitted.conv_int8 == pytest.approx(1.0 / (2.5 - 0.001 / 0.3), rel=1e-3)


def test_a_model_fitted_to_one_regime_fails_the_20_percent_check():
    """Efficiencies pinned by a compute-bound network alone mis-predict memory-bound ones: the LOO check fails."""
    from stack.deploy.latency.efficiency_fit import fit, leave_one_out, outside

    compute = {_ref(f"conv{i}", 2.0 * ms): _workload(ms) for i, ms in enumerate((1.0, 2.0, 4.0))}
    memory = {_ref(f"mem{i}", 3.0 * ms): _workload(0.01, ms, kind="memory") for i, ms in enumerate((1.0, 2.0))}
    prior = Efficiency(conv_int8=0.5, memory=0.9, launch_us=0.0)
    one_regime = fit(compute, prior, names=("conv_int8", "memory"))
    errors = {ref: one_regime.error(load, ref) for ref, load in memory.items()}
    assert len(outside(errors)) == 2  # memory kept its prior 0.9 where 1/3 was published: -63%
    assert not outside(leave_one_out({**compute, **memory}, prior, ("conv_int8", "memory")))


def test_every_reference_is_sourced_and_the_fit_covers_three_families():
    from stack.deploy.latency.references import FIT_TARGET, REFERENCES

    assert all(len(ref.source) > 40 and ("http" in ref.source or "docs/" in ref.source or "issue" in ref.source)
               for ref in REFERENCES)
    fitted = [ref for ref in REFERENCES if ref.target == FIT_TARGET]
    assert len(fitted) >= 6 and len({ref.family for ref in fitted}) >= 3
    assert {ref.precision for ref in fitted} == {"int8", "fp16", "fp32"}  # fp32: BEVDet's BEV-pool kernel


def test_gate_margin_comes_from_the_worst_optimistic_error():
    from stack.deploy.latency.margins import LOO_ERRORS, LOFO_ERRORS, gate_margin, target_margin

    assert gate_margin({"a": -0.2, "b": 0.3}) == 1.25 and gate_margin({"a": 0.1}) == 1.0
    orin = target_margin("orin")
    worst = min(list(LOO_ERRORS.values()) + [e for family in LOFO_ERRORS.values() for e in family.values()])
    assert orin.status == "validated" and orin.value == gate_margin({"w": worst}) and orin.value * (1 + worst) >= 0.995


def test_each_target_margin_comes_from_its_own_references():
    """orin-nx and orin-nano-super: their own references' worst error compounded with AGX Orin's worst family
    error; so they differ from each other and from AGX Orin's."""
    from stack.deploy.latency.margins import DEVICE_ERRORS, LOFO_ERRORS, target_margin

    family = min(e for errors in LOFO_ERRORS.values() for e in errors.values())
    for name in ("orin-nx", "orin-nano-super"):
        margin = target_margin(name)
        expected = 1 / ((1 + min(DEVICE_ERRORS[name].values())) * (1 + family))
        assert margin.status == "validated" and margin.references == len(DEVICE_ERRORS[name]) == 10
        assert margin.value == pytest.approx(expected, abs=0.005)
    assert len({target_margin(n).value for n in ("orin", "orin-nx", "orin-nano-super")}) == 3


def test_margins_follow_the_errors_they_are_given():
    """The rules on hand-made errors: a worse device reference raises that device's margin only."""
    from stack.deploy.latency.margins import margins_from

    loo, lofo = {"a": -0.1, "b": 0.2}, {"f1": {"a": -0.2}, "f2": {"b": 0.1}}
    margins = margins_from(loo, lofo, {"dev": {"y": -0.5, "z": 0.1}}, {"dev": -0.3})
    assert margins["orin"].value == 1.25  # worst of LOO and LOFO: -0.2
    assert margins["dev"].value == pytest.approx(1 / (0.5 * 0.8), abs=0.005)
    assert margins["*"].status == "unvalidated" and margins["*"].value == pytest.approx(1 / (0.8 * 0.7), abs=0.005)


def test_a_target_without_references_gets_the_conservative_margin_and_says_unvalidated():
    """orin-nano's original clocks and x86-gpu's L4 have no published reference: never AGX Orin's margin."""
    from stack.deploy.latency.margins import CONSERVATIVE_MARGIN, target_margin, validation_note

    for name in ("orin-nano", "x86-gpu", "some-new-target"):
        margin = target_margin(name)
        assert margin.status == "unvalidated" and margin.value == CONSERVATIVE_MARGIN
        assert margin.value > max(target_margin(n).value for n in ("orin", "orin-nx", "orin-nano-super"))
        assert validation_note(name).startswith("UNVALIDATED")


def test_leave_one_family_out_refits_without_the_family():
    """Three one-parameter families: leaving one out predicts it with the others' efficiency alone."""
    from stack.deploy.latency.efficiency_fit import leave_one_family_out

    def ref(name, family, published):
        from stack.deploy.latency.references import Reference
        return Reference(name, family, "none", (1,), "int8", published, "hand-made")

    loads = {ref("A", "fa", 2.0): _workload(1.0), ref("B", "fb", 2.0): _workload(1.0), ref("C", "fc", 4.0): _workload(1.0)}
    prior = Efficiency(conv_int8=0.9, launch_us=0.0)
    errors = {r.name: e for r, e in leave_one_family_out(loads, prior, ("conv_int8",), "linear").items()}
    assert errors["C"] == pytest.approx(2.0 / 4.0 - 1, abs=1e-3)  # fitted on A and B: e = 0.5
    assert errors["A"] == pytest.approx(8 ** 0.5 / 2.0 - 1, abs=1e-3)  # fitted on B and C: e = 1 / sqrt(8)


def test_predicted_p99_is_the_median_times_the_published_ratio(orin):
    """A network whose median fits but whose tail (median x P99_OVER_MEDIAN) overruns the p99 bar fails."""
    from dataclasses import replace

    from stack.deploy.gates.fps import predicted_gate
    from stack.deploy.latency.roofline import P99_OVER_MEDIAN, LayerCost, Prediction

    prediction = Prediction([LayerCost("net", ["Conv"], "int8", 1.0, 1.0, 40.0, "compute")])
    target = replace(orin, min_fps=20.0, max_p99_latency_ms=42.0)
    gate = predicted_gate(target, prediction, "note", margin=1.0)
    assert gate.p99_ms == pytest.approx(40.0 * P99_OVER_MEDIAN) and P99_OVER_MEDIAN > 1.0
    assert not gate.passed and "p99" in gate.reasons[0]
    assert predicted_gate(target, prediction, "note", margin=1.0, p99_ratio=1.0).passed


def test_a_heavier_network_predicts_proportionally_slower(orin):
    eff = Efficiency(conv_fp16=0.5, memory=0.7, launch_us=0.0)
    light = predict(_conv_graph(channels=256, size=64, residual=False), orin, efficiency=eff)
    heavy = predict(_conv_graph(channels=512, size=64, residual=False), orin, efficiency=eff)
    assert heavy.total_flops == pytest.approx(4 * light.total_flops)
    assert heavy.total_ms == pytest.approx(4 * light.total_ms, rel=0.05)


def test_targets_say_whether_they_have_references_of_their_own():
    from stack.deploy.latency.margins import validation_note
    from stack.deploy.latency.references import references_for

    assert "no published reference of its own" in validation_note("orin-nano")
    assert not references_for("orin-nano")
    assert "10 published references" in validation_note("orin-nano-super") and len(references_for("orin-nx")) == 10


def test_yolo11_rebuild_has_ultralytics_parameter_counts():
    from stack.deploy.latency.networks import YOLO11_PARAMETERS, Yolo11

    for scale in "nsm":
        assert sum(p.numel() for p in Yolo11(scale).parameters()) == YOLO11_PARAMETERS[scale]


def test_reference_graphs_are_built_once_and_cached_without_weights(tmp_path, monkeypatch):
    from stack.deploy.latency import networks as latency_nets

    monkeypatch.setenv("STACK_CACHE_DIR", str(tmp_path))
    messages = []
    model = latency_nets.reference_graph("resnet18", (1, 3, 64, 64), messages.append)
    assert len(messages) == 1 and "building the resnet18" in messages[0]
    assert all(not t.raw_data for t in model.graph.initializer if np.prod(t.dims) > latency_nets.STRIP_ABOVE)
    monkeypatch.setattr(latency_nets, "build_network", lambda builder: pytest.fail("rebuilt a cached graph"))
    again = latency_nets.reference_graph("resnet18", (1, 3, 64, 64), messages.append)
    assert len(messages) == 1 and len(again.graph.node) == len(model.graph.node)
    assert predict(again, load_target("orin", load_pipeline())).total_flops > 2 * 1.8e9 * (64 / 224) ** 2 * 0.9


@pytest.mark.slow
def test_stated_error_is_what_the_published_references_give():
    """Refit on the published references: the efficiencies, leave-one-out, leave-one-family-out and per-device
    errors the margins use are what the fit gives today (builds the reference graphs once per cache)."""
    from stack.deploy.latency import margins
    from stack.deploy.latency.roofline import FITTED_EFFICIENCY
    from stack.deploy.latency.efficiency_fit import fit, outside, table, workloads
    from stack.deploy.latency.references import FITTED, FIT_TARGET

    targets = load_pipeline().targets
    loads = {r: w for r, w in workloads(targets).items() if r.target == FIT_TARGET}
    mlperf_only = fit({r: w for r, w in loads.items() if r.builder == "resnet50"})  # the old one-point fit
    assert len(outside({r: mlperf_only.error(w, r) for r, w in loads.items()})) >= 3
    result = table(targets)
    for name in FITTED:
        assert getattr(result["efficiency"], name) == pytest.approx(getattr(FITTED_EFFICIENCY, name), rel=0.01)
    assert result["loo"] == pytest.approx(margins.LOO_ERRORS, abs=0.005)
    for family, errors in margins.LOFO_ERRORS.items():
        assert result["lofo"][family] == pytest.approx(errors, abs=0.005)
    for target, errors in margins.DEVICE_ERRORS.items():
        assert result["devices"][target] == pytest.approx(errors, abs=0.005)
    # Within +-25% but BERT-Large: the one reference that pins matmul, so without it matmul is at its prior and
    # BERT is over-predicted (+71%: pessimistic, it widens no margin).
    assert {k: e > 0.25 for k, e in outside(margins.LOO_ERRORS, 0.25).items()} == {
        "BERT-Large + SQuAD span head, 384 tokens int8": True}
    assert all(result["margins"][name].value == margins.target_margin(name).value for name in result["margins"])


@pytest.mark.parametrize("name, words, status", [("orin-nano", "no published reference of its own", "unvalidated"),
                                                 ("x86-gpu", "UNVALIDATED", "unvalidated"),
                                                 ("orin-nano-super", "validated on 10 published references", "validated")])
def test_the_predicted_gate_states_its_error_and_the_targets_own_references(tmp_path, name, words, status):
    """What a deploy report's FPS line says for a predicted target: the LOO and LOFO spreads, the target's own
    margin (the conservative one when it has no reference) and p99 ratio, and whether it is validated."""
    from types import SimpleNamespace

    from stack.deploy.latency.margins import target_margin
    from stack.deploy.latency.roofline import P99_OVER_MEDIAN
    from stack.deploy.orchestrate import _predict

    path = tmp_path / "m.onnx"
    onnx.save(_conv_graph(channels=64, size=64), str(path))
    result = {"target": name}
    _predict(tmp_path, path, load_target(name, load_pipeline()), SimpleNamespace(keep_fp32=[]), result, lambda m: None)
    gate = result["fps"]
    assert words in gate["how"] and "leave-one-out error on 14 published AGX Orin references" in gate["how"]
    assert "leave-one-family-out" in gate["how"] and gate["validation"] == status
    assert gate["median_ms"] == pytest.approx(gate["raw_median_ms"] * target_margin(name).value)
    assert gate["p99_ms"] == pytest.approx(gate["median_ms"] * P99_OVER_MEDIAN)


@pytest.mark.slow
def test_bert_reference_is_costed_as_matmul_and_pins_that_class(orin):
    """MLPerf's BERT-Large (384 tokens, INT8): 232 GOP of projections and 14.5 of attention, every one an INT8 matmul
    layer, most of its predicted time. Fitted, it moves matmul off its prior; predicted with the prior (its family
    left out: no other reference pins matmul) it errs by the recorded leave-one-family-out error."""
    from dataclasses import replace

    from stack.deploy.latency import margins
    from stack.deploy.latency.efficiency_fit import Fit, fit, leave_one_family_out, workloads
    from stack.deploy.latency.networks import reference_graph
    from stack.deploy.latency.references import FIT_TARGET, PRIOR, REFERENCES
    from stack.deploy.latency.roofline import FITTED_EFFICIENCY

    bert = next(r for r in REFERENCES if r.builder == "bert_large")
    model = reference_graph(bert.builder, bert.input_shape)
    assert len({n.name for n in model.graph.node}) == len(model.graph.node)  # layers share weights, not names
    prediction = predict(model, orin, all_int8=True, efficiency=FITTED_EFFICIENCY)
    matmuls = [layer for layer in prediction.layers if layer.ops[0] == "MatMul"]
    assert all(layer.kind == "matmul" and layer.precision == "int8" for layer in matmuls)
    assert sum(layer.ops == ["MatMul", "Div", "Softmax", "MatMul"] for layer in matmuls) == 24
    projections = 24 * (4 * 1024 * 1024 + 2 * 1024 * 4096) * 384 * 2
    attention = 24 * 2 * (2 * 16 * 384 * 384 * 64)
    assert sum(layer.flops for layer in matmuls) == pytest.approx(projections + attention + 2 * 384 * 1024 * 2)
    assert sum(layer.time_ms for layer in matmuls) >= 0.7 * prediction.total_ms

    loads = {r: w for r, w in workloads({FIT_TARGET: orin}, [r for r in REFERENCES if r.target == FIT_TARGET]).items()
             if r.fitted}
    fitted = fit(loads)
    assert fitted.efficiency.matmul == pytest.approx(FITTED_EFFICIENCY.matmul, rel=0.01)
    assert abs(fitted.efficiency.matmul - PRIOR.matmul) > 0.1 and abs(fitted.error(loads[bert], bert)) < 0.01
    recorded = margins.LOFO_ERRORS["BERT encoder"][bert.name + " " + bert.precision]
    at_prior = Fit(replace(fitted.efficiency, matmul=PRIOR.matmul), fitted.overhead_ms)
    assert at_prior.error(loads[bert], bert) == pytest.approx(recorded, abs=0.01)
    assert leave_one_family_out(loads)[bert] == pytest.approx(recorded, abs=0.005)


@pytest.mark.slow
def test_bevdet_bev_pool_reference_pins_gather(orin):
    """BEVDet-TensorRT's BEV pool (0.571 ms on AGX Orin) is the one reference that gathers from an L2-resident table:
    fitted, it moves gather off its prior to an effective L2 gather bandwidth above DRAM's; with its family left out
    gather keeps the prior, and the reference errs by the recorded leave-one-family-out error."""
    from dataclasses import replace

    from stack.deploy.latency import margins
    from stack.deploy.latency.efficiency_fit import Fit, fit, leave_one_family_out, workloads
    from stack.deploy.latency.references import FIT_TARGET, PRIOR, REFERENCES
    from stack.deploy.latency.roofline import FITTED_EFFICIENCY

    pool = next(r for r in REFERENCES if r.builder == "bevdet_bev_pool")
    loads = {r: w for r, w in workloads({FIT_TARGET: orin}, [r for r in REFERENCES if r.target == FIT_TARGET]).items()
             if r.fitted}
    assert loads[pool].share_by_kind(FITTED_EFFICIENCY) == {"gather": pytest.approx(pool.latency_ms, rel=0.01)}
    assert all("gather" not in load.share_by_kind(FITTED_EFFICIENCY) for r, load in loads.items() if r is not pool)
    fitted = fit(loads)
    assert fitted.efficiency.gather == pytest.approx(FITTED_EFFICIENCY.gather, rel=0.01)
    assert fitted.efficiency.gather > 1.0 > PRIOR.gather_dram and abs(fitted.error(loads[pool], pool)) < 0.01
    recorded = margins.LOFO_ERRORS["BEV pooling"][pool.name + " " + pool.precision]
    at_prior = Fit(replace(fitted.efficiency, gather=PRIOR.gather), fitted.overhead_ms)
    assert at_prior.error(loads[pool], pool) == pytest.approx(recorded, abs=0.01)
    assert leave_one_family_out(loads)[pool] == pytest.approx(recorded, abs=0.005)
