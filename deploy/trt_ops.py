"""Which ONNX operators TensorRT's ONNX parser imports natively, for the targets' versions.

From onnx-tensorrt `docs/operators.md` (the support matrix shipped with TensorRT 8.6
for JetPack 5 and 10.3 for JetPack 6): the operators below are listed as supported in
both, so a graph made only of them builds on every TensorRT target without plugins.
Operators outside this list are reported, never silently accepted.

Restrictions that matter for this stack and are checked on the graph, not just by name:
- `ScatterND` / `ScatterElements` with a `reduction` attribute: 8.6 ignores it (silently
  wrong sums), 10.x rejects it or needs a plugin. The BEV pooling must be lowered without it.
- `QuantizeLinear` / `DequantizeLinear`: zero points must be 0 (symmetric INT8).
- `Conv` / `ConvTranspose` weights must be initializers (true after export with constant folding).
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

TENSORRT_VERSIONS = ("8.6 (JetPack 5)", "10.3 (JetPack 6)")

SUPPORTED = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast Ceil
Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual
GridSample HardSigmoid HardSwish Identity If InstanceNormalization IsNaN
LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LpNormalization LpPool MatMul
Max MaxPool Mean Min Mul Neg Not Or Pad Pow PRelu QuantizeLinear Range ReduceL1 ReduceL2
ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare
Relu Reshape Resize Round ScatterElements ScatterND Selu Shape Sigmoid Sign Sin Sinh Size Slice
Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK
Transpose Trilu Unsqueeze Where Xor
""".split())
"""Operators imported natively by TensorRT 8.6 and 10.3 (default ONNX domain)."""


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Operator type -> number of nodes, sorted by type."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def tensorrt_problems(model: onnx.ModelProto) -> list[str]:
    """Why TensorRT could not import `model` natively (empty when every node is fine)."""
    problems = [f"{op} ({count} node{'s' if count > 1 else ''}) is not in TensorRT's native operator list"
                for op, count in op_counts(model).items() if op not in SUPPORTED]
    constants = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in ("ScatterND", "ScatterElements") and attributes.get("reduction", b"none") not in (b"none", "none"):
            problems.append(f"{node.name or node.op_type}: {node.op_type} with reduction="
                            f"{attributes['reduction']!r} (ignored by TensorRT 8.6, rejected by 10.x)")
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2:
            zero = constants.get(node.input[2])
            if zero is not None and numpy_helper.to_array(zero).any():
                problems.append(f"{node.name}: {node.op_type} with a nonzero zero point (TensorRT needs symmetric INT8)")
    return problems
