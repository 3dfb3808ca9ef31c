"""Predicted latency on a target without the target: a per-layer roofline over the ONNX graph.

Used where the engine cannot be timed here (TensorRT targets on a GPU-less machine);
the report then says "predicted", never "measured". Each layer's time is

    max(FLOPs / (peak(precision) * compute_eff), bytes / (bandwidth * memory_eff)) + launch

computed on TensorRT's view of the graph rather than ONNX's node list:

- Q/DQ pairs fold into the layer that consumes them and set its precision (INT8 where
  both activation and weight arrive through DequantizeLinear, else the target's float
  precision: fp16 for `best`/`fp16`/`int8`, fp32 for nodes kept fp32 by name);
- conv/matmul + bias + BatchNorm + activation (SiLU written as x * sigmoid(x) and GELU as
  x * 0.5 * (1 + erf(x / sqrt 2)) included) + residual Add fuse into one kernel (one read of the
  input and weights, one write of the output, plus the residual);
- attention, MatMul -> [scale] -> [mask Add] -> Softmax -> MatMul, is one fused kernel whose scores
  never leave the chip (TensorRT's multi-head-attention fusion; NVIDIA's MLPerf BERT engine runs it as
  its fused-MHA plugin), and a Transpose whose only consumers are matmuls is the GEMM's operand layout,
  no kernel of its own;
- shape plumbing (Reshape, Squeeze, Shape, Constant, ...) and Concat (TensorRT's concat
  elimination) cost nothing;
- chains of elementwise operators (normalisation, activations, residual adds not fused
  into a conv) become one pointwise kernel: outside inputs read once, last output written;
- a gather whose table fits in the target's L2 cache reads the table once from DRAM and its rows from L2;
  gathers, elementwise weighting and a scatter-add (a segment sum) in a chain are one fused pooling kernel
  (`_pools`), as BEVPoolv2 runs BEV pooling;
- everything else is a memory-bound kernel that reads its inputs and writes its outputs.

Efficiencies are per operator class (`KINDS`) and precision, fitted to 14 published Jetson AGX
Orin TensorRT timings from five network families (`stack.deploy.latency.references.REFERENCES`,
refit by `stack bench latency`); each reference's leave-one-out and leave-one-family-out error is the
stated error, and each target's gate margin comes from the errors on its own references
(`stack.deploy.latency.margins`): docs/results/deploy.md, "The latency model".
Roofline model: Williams, Waterman, Patterson, CACM 2009
(https://doi.org/10.1145/1498765.1498785).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import shape_inference

FREE_OPS = {"Constant", "Shape", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Dropout",
            "QuantizeLinear", "DequantizeLinear", "ConstantOfShape", "Range", "Size", "Concat"}
"""Operators TensorRT folds away or evaluates at build time. Concat too: TensorRT's concatenation-layer
elimination has each producer write straight into its slice of the output (TensorRT Developer Guide,
"Types of Fusions")."""
COMPUTE_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm"}
FUSABLE_EPILOGUE = {"Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid", "HardSwish", "Elu", "Selu",
                    "Add", "Mul", "Sub", "Div", "BatchNormalization", "QuantizeLinear", "DequantizeLinear", "Gelu"}
POINTWISE = {"Add", "Sub", "Mul", "Div", "Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid", "HardSwish",
             "Elu", "Selu", "Cast", "Exp", "Log", "Sqrt", "Pow", "Erf", "Neg", "Abs", "Reciprocal", "Max", "Min",
             "Gelu"}
"""Elementwise operators TensorRT fuses into one pointwise kernel when they form a chain."""
BYTES = {"int8": 1, "fp16": 2, "fp32": 4}
GATHER_OPS = {"Gather", "GatherElements", "GatherND", "GridSample"}
"""Operators that read rows of a table (input 0) chosen by an index tensor (`_gather_cost`). GridSample (the temporal
network's BEV warp, stack.models.temporal) reads its 4 bilinear neighbours per output element, mostly the same lines
as its neighbour's, as a gather by a grid."""
SCATTER_ADD = {"ScatterND", "ScatterElements"}
"""With reduction="add" and fed by gathers: the segment sum of a fused pooling kernel (`_pools`)."""
L2_CACHE_BYTES = {("8.7", 16): 4 << 20, ("8.7", 8): 2 << 20, ("8.9", 58): 48 << 20}
"""GPU L2 cache by (compute capability, SMs), the fields a target names its GPU by. Jetson AGX Orin: 4 MB ("two GPCs,
16 SMs ... 4 MB L2", NVIDIA Jetson AGX Orin Series Technical Brief v1.2). Orin NX / Orin Nano (8 SMs of the same
GA10B): 2 MB *assumed*, not found in their data sheets: half the SMs and half the memory bus (128-bit LPDDR5), and
an NVIDIA GPU's L2 slices sit with its memory partitions. L4 (AD104): 48 MB (NVIDIA Ada GPU architecture). Other
devices: 0, every gather keeps the DRAM cost."""


KINDS = ("conv", "dwconv", "matmul", "memory", "gather", "gather_dram")
"""Operator classes with their own efficiency: dense conv (tensor cores), grouped/depthwise conv,
matmul/attention, pointwise and other memory-bound kernels, gathers from an L2-resident table (BEV pooling),
gathers from a table larger than L2 (BERT's word embeddings)."""


@dataclass(frozen=True)
class Efficiency:
    """Fraction of the datasheet peaks a TensorRT engine reaches at batch 1, per operator class, and the
    per-kernel overhead. Compute efficiencies multiply the peak of the layer's precision (fp32 layers use
    the fp16 figure against the fp32 peak); memory efficiencies multiply the DRAM bandwidth."""

    conv_int8: float = 0.5
    conv_fp16: float = 0.5
    dwconv: float = 0.05
    """Grouped/depthwise convs: few MACs per byte, CUDA-core kernels far from the tensor-core peak."""
    matmul: float = 0.3
    """Batch-1 attention matmuls are small and skinny."""
    memory: float = 0.7
    gather: float = 1.0
    """Rows a gather reads from a table that fits in L2, as a multiple of DRAM bandwidth: the effective L2 gather
    bandwidth over DRAM's (the table itself, indices and output stream from DRAM at `memory`)."""
    gather_dram: float = 0.25
    """Rows gathered from a table larger than L2: random rows reach a fraction of streaming bandwidth."""
    launch_us: float = 4.0

    def compute(self, kind: str, precision: str) -> float:
        if kind == "dwconv":
            return self.dwconv
        if kind == "matmul":
            return self.matmul
        return self.conv_int8 if precision == "int8" else self.conv_fp16

    def bandwidth(self, kind: str) -> float:
        """Of a layer's DRAM bytes; a gather's L2 rows go at `gather` (`_roofline`)."""
        return self.gather_dram if kind == "gather_dram" else self.memory


FITTED_EFFICIENCY = Efficiency(conv_int8=0.3113, conv_fp16=0.4407, matmul=0.5732, memory=0.7465, gather=1.169)
"""`stack.deploy.latency.efficiency_fit.fit` on the 14 AGX Orin references (`stack bench latency` refits and prints
it; the slow test checks these figures are what the fit gives). Matmul is BERT-Large's (MLPerf BERT-99, INT8: 0.57
of the dense INT8 peak on its 384 x 1024 x {1024, 4096} GEMMs). Gather is BEVDet's BEV pool (BEVPoolv2, FP32): 116 MB
of rows from a 3.3 MB table pair at 1.17 x 204.8 GB/s, an effective 239 GB/s from L2. The other fields are the
priors."""
P99_OVER_MEDIAN = 1.13
"""Predicted p99 = predicted median x this. Published Jetson AGX Orin runs: trtexec on a quiet board with
locked clocks gives p99/median 1.001 (IGEV-YOLO8 issue #8, AGX Orin 32GB, FP16: 76.45 / 76.34 ms); an
application sharing the GPU gives a wider spread: CUDA-BEVFusion's camera backbone, steady state, ran
12.73-14.36 ms frame to frame (Lidar_AI_Solution issue #175, AGX Orin, INT8), 1.13x. A car's computer
shares its GPU, so the larger ratio is used. MLPerf SingleStream publishes p90 only, which does not
extrapolate to p99 without a distribution, so it is not used here."""
DEFAULT_EFFICIENCY = FITTED_EFFICIENCY


@dataclass
class LayerCost:
    name: str
    ops: list
    precision: str
    flops: float
    bytes: float
    time_ms: float
    bound: str
    """`compute`, `memory` or `launch`: which term of the roofline dominates."""
    kind: str = "memory"
    """Operator class (`KINDS`), which picks the efficiency."""
    l2_bytes: float = 0.0
    """Rows a gather reads from an L2-resident table (`bytes` are then its DRAM traffic)."""


@dataclass
class Prediction:
    layers: list = field(default_factory=list)
    efficiency: Efficiency = field(default_factory=Efficiency)

    @property
    def total_ms(self) -> float:
        return float(sum(layer.time_ms for layer in self.layers))

    @property
    def total_flops(self) -> float:
        return float(sum(layer.flops for layer in self.layers))

    def by_precision(self) -> dict:
        out: dict = {}
        for layer in self.layers:
            out[layer.precision] = out.get(layer.precision, 0.0) + layer.time_ms
        return out

    def to_dict(self) -> dict:
        return {"total_ms": self.total_ms, "total_gflops": self.total_flops / 1e9, "efficiency": asdict(self.efficiency),
                "by_precision_ms": self.by_precision(), "layers": [asdict(layer) for layer in self.layers]}


class _Graph:
    """Shapes, constants, producers and consumers of an ONNX graph after shape inference."""

    def __init__(self, model: onnx.ModelProto):
        model = shape_inference.infer_shapes(model)
        graph = model.graph
        self.nodes = list(graph.node)
        self.constants = {init.name: tuple(init.dims) for init in graph.initializer}
        self.shapes = dict(self.constants)
        for info in list(graph.value_info) + list(graph.input) + list(graph.output):
            dims = info.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                self.shapes[info.name] = tuple(d.dim_value for d in dims)
        for node in self.nodes:
            if node.op_type == "Constant":
                for attribute in node.attribute:
                    if attribute.name == "value":
                        self.constants[node.output[0]] = tuple(attribute.t.dims)
        self.producer = {out: node for node in self.nodes for out in node.output}
        self.consumers: dict = {}
        for node in self.nodes:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)

    def elements(self, name: str) -> int:
        return int(np.prod(self.shapes.get(name, (0,)))) if name else 0

    def is_constant(self, name: str) -> bool:
        if name in self.constants:
            return True
        producer = self.producer.get(name)  # a DequantizeLinear of a constant weight is a weight
        return producer is not None and producer.op_type == "DequantizeLinear" and producer.input[0] in self.constants

    def from_dq(self, name: str) -> bool:
        producer = self.producer.get(name)
        return producer is not None and producer.op_type == "DequantizeLinear"


def predict(model: onnx.ModelProto, target, keep_fp32: tuple = (), efficiency: Efficiency | None = None,
            all_int8: bool = False) -> Prediction:
    """Per-layer predicted latency of `model` on `target` (a `stack.pipeline.Target` with peaks).

    `all_int8` treats every conv/matmul as INT8 without Q/DQ nodes (for reference networks
    whose published engines are fully INT8).
    """
    graph, efficiency = _Graph(model), efficiency or DEFAULT_EFFICIENCY
    float_precision = "fp32" if target.precision == "fp32" else "fp16"
    l2, pools = l2_cache_bytes(target), _pools(graph)
    absorbed = {n.name for members in pools.values() for n in members}
    layers = []
    for node in graph.nodes:
        if node.name in absorbed or node.op_type in FREE_OPS or _operand_layout(graph, node):
            continue
        rows = 0.0  # bytes a gather reads from L2
        kept = any(p and p in node.name for p in keep_fp32)  # an fp32 layer moves 4-byte elements too
        precision = "fp32" if kept else float_precision
        if node.op_type in COMPUTE_OPS:
            quantized = all_int8 or (graph.from_dq(node.input[0]) and graph.from_dq(node.input[1]))
            precision = "int8" if quantized and not kept else precision
            attention = _attention(graph, node, absorbed)
            chain, extra = _epilogue(graph, attention[-1] if attention else node, absorbed)
            chain = attention + chain
            absorbed.update(n.name for n in chain)
            flops, nbytes = _compute_cost(graph, node, chain, extra, precision)
            if attention:  # the scores stay on chip: V (and a mask) read once more, nothing else
                flops += _matmul_flops(graph, attention[-1])
                inside = {node.output[0]} | {n.output[0] for n in attention}
                nbytes += BYTES[precision] * sum(graph.elements(name) for n in attention for name in n.input
                                                 if name and name not in inside and not graph.is_constant(name))
            ops = [node.op_type] + [n.op_type for n in chain if n.op_type not in ("QuantizeLinear", "DequantizeLinear")]
            kind = _compute_kind(graph, node)
        elif node.op_type in POINTWISE:
            chain = _pointwise_chain(graph, node, absorbed)
            absorbed.update(n.name for n in chain)
            flops, nbytes = _pointwise_cost(graph, [node] + chain, precision)
            ops = [n.op_type for n in [node] + chain if n.op_type not in ("QuantizeLinear", "DequantizeLinear")]
            kind = "memory"
        elif node.op_type in GATHER_OPS or node.name in pools:  # one gather kernel, or a fused pooling one
            members = pools.get(node.name, [])
            gathers = [n for n in members if n.op_type in GATHER_OPS] or [node]
            flops = float(sum(graph.elements(n.output[0]) for n in members if n.op_type not in FREE_OPS | GATHER_OPS)
                          + graph.elements(node.input[2])) if members else _elementwise_cost(graph, node, precision)
            nbytes, rows, kind = _gather_cost(graph, gathers, list(node.input[1:2]) if members else [],
                                              node.output[0], precision, l2)
            ops = [n.op_type for n in members if n.op_type not in FREE_OPS] + [node.op_type]
        else:
            flops, nbytes, ops = _elementwise_cost(graph, node, precision), _io_bytes(graph, node, precision), [node.op_type]
            kind = "memory"
        layers.append(_roofline(node.name or node.op_type, ops, precision, flops, nbytes, target, efficiency, kind,
                                rows))
    return Prediction(layers, efficiency)


def _compute_kind(graph: _Graph, node) -> str:
    """`dwconv` for a grouped conv, `matmul` for MatMul/Gemm, else `conv`."""
    if node.op_type in ("MatMul", "Gemm"):
        return "matmul"
    groups = next((a.i for a in node.attribute if a.name == "group"), 1)
    return "dwconv" if groups > 1 else "conv"


def _operand_layout(graph: _Graph, node) -> bool:
    """A Transpose read only by matmuls (through Reshapes): TensorRT's GEMMs take transposed and strided
    operands (IMatrixMultiplyLayer's MatrixOperation::kTRANSPOSE, strided batched GEMM), so the head split of
    attention (view + transpose, K^T) costs no kernel; NVIDIA's BERT engine reads its QKV layout in place."""
    if node.op_type != "Transpose":
        return False
    pending, readers = [node.output[0]], []
    while pending:
        for consumer in graph.consumers.get(pending.pop(), []):
            if consumer.op_type in ("Reshape", "Transpose"):
                pending.append(consumer.output[0])
            else:
                readers.append(consumer)
    return bool(readers) and all(n.op_type in ("MatMul", "Gemm") for n in readers)


def _attention(graph: _Graph, node, absorbed: set) -> list:
    """[scale, mask Add, Softmax, layout ops, MatMul] after `node` when it computes attention scores Q K^T that only
    a softmax and a second MatMul read: one fused kernel in TensorRT (multi-head-attention fusion, TensorRT Developer
    Guide, https://docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/transformers-fused-attention.html;
    in NVIDIA's MLPerf BERT engine the CustomQKVToContextPluginDynamic plugin, mlcommons/inference_results_v4.0
    closed/NVIDIA/code/bert/tensorrt/README.md), else []."""
    if node.op_type != "MatMul" or any(graph.is_constant(name) for name in node.input):
        return []

    def only_reader(tensor):
        readers = graph.consumers.get(tensor, [])
        return readers[0] if len(readers) == 1 and readers[0].name not in absorbed else None

    chain, nxt = [], only_reader(node.output[0])
    for ops, required in ((("Mul", "Div"), False), (("Add",), False), (("Softmax",), True)):
        if nxt is not None and nxt.op_type in ops:
            chain.append(nxt)
            nxt = only_reader(nxt.output[0])
        elif required:
            return []
    while nxt is not None and nxt.op_type in ("Transpose", "Reshape"):
        chain.append(nxt)
        nxt = only_reader(nxt.output[0])
    return chain + [nxt] if nxt is not None and nxt.op_type == "MatMul" else []


def _epilogue(graph: _Graph, node, absorbed: set) -> tuple[list, list]:
    """Nodes TensorRT fuses after a conv/matmul, and the extra tensors they read (residuals)."""
    chain, extra, current = [], [], node.output[0]
    while True:
        consumers = graph.consumers.get(current, [])
        activation = _silu(graph, current, consumers, absorbed) or _gelu(graph, current, consumers, absorbed)
        if activation:  # x * sigmoid(x), erf GELU: TensorRT fuses them as one activation
            chain += activation
            current = activation[-1].output[0]
            continue
        if len(consumers) != 1 or consumers[0].op_type not in FUSABLE_EPILOGUE or consumers[0].name in absorbed:
            return chain, extra
        nxt = consumers[0]
        others = [name for name in nxt.input[1:] if name and name != current] if nxt.op_type != "QuantizeLinear" else []
        others += [name for name in nxt.input[:1] if name != current]
        extra += [name for name in others if not graph.is_constant(name)]
        if len(extra) > 1:  # more than one residual: TensorRT would not fuse this either
            return chain, extra[:1]
        chain.append(nxt)
        current = nxt.output[0]


def _silu(graph: _Graph, tensor: str, consumers: list, absorbed: set) -> list:
    """[Sigmoid, Mul] when `tensor` feeds exactly x * sigmoid(x) (SiLU/Swish as exporters write it), else []."""
    if len(consumers) != 2 or any(n.name in absorbed for n in consumers):
        return []
    sigmoid = next((n for n in consumers if n.op_type == "Sigmoid"), None)
    mul = next((n for n in consumers if n.op_type == "Mul"), None)
    if sigmoid is None or mul is None or set(mul.input) != {tensor, sigmoid.output[0]}:
        return []
    return [sigmoid, mul] if graph.consumers.get(sigmoid.output[0], []) == [mul] else []


def _gelu(graph: _Graph, tensor: str, consumers: list, absorbed: set) -> list:
    """[Div, Erf, Add, Mul, Mul] when `tensor` feeds exactly x * 0.5 * (1 + erf(x / sqrt 2)) (GELU as PyTorch exports
    it below opset 20), else []. TensorRT fuses GELU into the GEMM before it as it does ReLU ("TensorRT can fuse the
    fc + gelu layer", PaddlePaddle/Paddle#38399); NVIDIA's BERT engines never write the pre-activation."""
    if len(consumers) != 2 or any(n.name in absorbed for n in consumers):
        return []
    div = next((n for n in consumers if n.op_type == "Div"), None)
    mul = next((n for n in consumers if n.op_type == "Mul"), None)
    if div is None or mul is None:
        return []
    chain = [div]
    for op in ("Erf", "Add", "Mul"):
        readers = graph.consumers.get(chain[-1].output[0], [])
        if len(readers) != 1 or readers[0].op_type != op:
            return []
        chain.append(readers[0])
    if chain[-1] != mul:
        return []
    half = graph.consumers.get(mul.output[0], [])
    if len(half) == 1 and half[0].op_type == "Mul" and all(graph.is_constant(name) for name in half[0].input
                                                           if name != mul.output[0]):
        chain.append(half[0])
    return chain


def _pointwise_chain(graph: _Graph, node, absorbed: set) -> list:
    """Elementwise nodes (and Q/DQ) that follow `node` one-to-one: one fused pointwise kernel."""
    chain, current = [], node.output[0]
    while True:
        consumers = graph.consumers.get(current, [])
        if len(consumers) != 1 or consumers[0].name in absorbed:
            return chain
        nxt = consumers[0]
        if nxt.op_type not in POINTWISE | {"QuantizeLinear", "DequantizeLinear"}:
            return chain
        chain.append(nxt)
        current = nxt.output[0]


def _pointwise_cost(graph: _Graph, nodes: list, precision: str) -> tuple[float, float]:
    """One read of every outside input, one write of the last output."""
    produced = {out for node in nodes for out in node.output}
    reads = {name for node in nodes for name in node.input
             if name and name not in produced and not graph.is_constant(name)}
    elements = sum(graph.elements(name) for name in reads) + graph.elements(nodes[-1].output[0])
    flops = float(sum(max((graph.elements(name) for name in node.output), default=0) for node in nodes))
    return flops, float(elements * BYTES[precision])


def _compute_cost(graph: _Graph, node, chain: list, extra: list, precision: str) -> tuple[float, float]:
    out = node.output[0]
    out_elems = graph.elements(out)
    weight_shape = graph.shapes.get(node.input[1], ())
    if not weight_shape and graph.from_dq(node.input[1]):
        weight_shape = graph.shapes.get(graph.producer[node.input[1]].input[0], ())
    if node.op_type == "Conv" and len(weight_shape) >= 3:  # (Cout, Cin/g, k...): MACs per output element
        flops = 2.0 * out_elems * int(np.prod(weight_shape[1:]))
    elif node.op_type == "ConvTranspose" and len(weight_shape) >= 3:  # (Cin, Cout/g, k...): MACs per input element
        flops = 2.0 * graph.elements(node.input[0]) * int(np.prod(weight_shape[1:]))
    else:
        flops = _matmul_flops(graph, node)
    size = BYTES[precision]
    weights = graph.elements(node.input[1]) or int(np.prod(weight_shape or (0,)))
    activations = graph.elements(node.input[0]) + graph.elements(chain[-1].output[0] if chain else out)
    activations += sum(graph.elements(name) for name in extra)
    weight_bytes = weights * size if graph.is_constant(node.input[1]) else graph.elements(node.input[1]) * size
    return flops, activations * size + weight_bytes


def _matmul_flops(graph: _Graph, node) -> float:
    """2 x output elements x the reduced dimension of a MatMul/Gemm."""
    k = graph.shapes.get(node.input[0], (1,))[-1]
    if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
        k = graph.shapes.get(node.input[0], (1, 1))[0]
    return 2.0 * graph.elements(node.output[0]) * k


def _elementwise_cost(graph: _Graph, node, precision: str) -> float:
    per_element = {"Softmax": 5, "LayerNormalization": 8, "Resize": 4, "Exp": 4, "Sigmoid": 4, "Tanh": 4,
                   "GridSample": 8}  # bilinear: 4 multiply-adds per output element
    return float(per_element.get(node.op_type, 1) * max((graph.elements(name) for name in node.input), default=0))


def _io_bytes(graph: _Graph, node, precision: str) -> float:
    size = BYTES[precision]
    touched = [name for name in list(node.input) + list(node.output) if name and not graph.is_constant(name)]
    return float(sum(graph.elements(name) for name in touched) * size)


def l2_cache_bytes(target) -> int:
    """The L2 cache of `target`'s GPU (`L2_CACHE_BYTES`; 0 when unknown)."""
    return L2_CACHE_BYTES.get((target.device_compute_capability, target.device_multiprocessors), 0)


def _gather_cost(graph: _Graph, gathers: list, indices: list, output: str, precision: str,
                 l2: int) -> tuple[float, float, str]:
    """(DRAM bytes, L2 bytes, kind) of one gather kernel: `gathers` read rows of their tables, `indices` are the
    kernel's other index inputs (a scatter's), `output` is what it writes.

    A table that fits in L2 is read once from DRAM and its rows from L2 (kind `gather`): a row read again is an L2
    hit (BEVDet's BEV pool reads 114 MB of feature rows from a 1.35 MB table). Indices, constant or not, the output
    and, in the same kernel, the rows of a table too large for L2 stream from DRAM. A kernel with no table in L2 keeps
    the DRAM cost (`gather_dram`): its rows, output and non-constant indices."""
    size = BYTES[precision]
    dram = l2_rows = dram_rows = 0
    for table in dict.fromkeys(g.input[0] for g in gathers):
        rows = size * sum(graph.elements(g.output[0]) for g in gathers if g.input[0] == table)
        if 0 < size * graph.elements(table) <= l2:
            dram, l2_rows = dram + size * graph.elements(table), l2_rows + rows
        else:
            dram_rows += rows
    index_names = [name for g in gathers for name in g.input[1:] if name] + indices
    written = size * graph.elements(output)
    if not l2_rows:
        dynamic = size * sum(graph.elements(name) for name in index_names if not graph.is_constant(name))
        return float(dram_rows + written + dynamic), 0.0, "gather_dram"
    index = size * sum(graph.elements(name) for name in index_names)
    return float(dram + dram_rows + index + written), float(l2_rows), "gather"


def _pools(graph: _Graph) -> dict:
    """{scatter-add node: the gathers and elementwise nodes that feed its updates}, one fused pooling kernel each.

    BEVPoolv2 (BEVDet, https://arxiv.org/abs/2211.17111) and our own `stack::bev_pool` sum, per BEV cell, depth x
    feature over the cell's points in one kernel: gathered rows and products stay in registers and the BEV is written
    once. In ONNX that is Gather(s) -> [Mul] -> ScatterND/ScatterElements(reduction="add"); a chain whose
    intermediate tensors are read outside it is not fused."""
    pools = {}
    for node in graph.nodes:
        reduction = next((a.s.decode() for a in node.attribute if a.name == "reduction"), "none")
        if node.op_type not in SCATTER_ADD or reduction != "add" or len(node.input) < 3:
            continue
        members, pending, fused = {}, [node.input[2]], True
        while pending and fused:
            producer = graph.producer.get(pending.pop())
            if producer is None or producer.name in members or producer.op_type in ("Constant", "ConstantOfShape"):
                fused = producer is not None  # a graph input: nothing to fuse with
                continue
            fused = producer.op_type in GATHER_OPS | POINTWISE | FREE_OPS
            if fused:
                members[producer.name] = producer
                if producer.op_type not in GATHER_OPS:
                    pending += [name for name in producer.input if name and not graph.is_constant(name)]
        inside = set(members) | {node.name}
        fused = fused and all(c.name in inside for n in members.values() for c in graph.consumers.get(n.output[0], []))
        if fused and any(n.op_type in GATHER_OPS for n in members.values()):
            pools[node.name] = [n for n in graph.nodes if n.name in members]
    return pools


def _roofline(name, ops, precision, flops, nbytes, target, efficiency: Efficiency, kind: str = "memory",
              l2_bytes: float = 0.0) -> LayerCost:
    compute_ms, memory_ms = ideal_times(precision, flops, nbytes, target)
    compute_ms /= efficiency.compute(kind, precision)
    l2_ms = ideal_times(precision, 0, l2_bytes, target)[1]  # at DRAM bandwidth; `gather` is L2's multiple of it
    memory_ms = memory_ms / efficiency.bandwidth(kind) + l2_ms / efficiency.gather
    launch_ms = efficiency.launch_us * 1e-3
    bound = "compute" if compute_ms >= max(memory_ms, launch_ms) else "memory" if memory_ms >= launch_ms else "launch"
    return LayerCost(name, ops, precision, float(flops), float(nbytes), max(compute_ms, memory_ms) + launch_ms, bound,
                     kind, float(l2_bytes))


def ideal_times(precision: str, flops: float, nbytes: float, target) -> tuple[float, float]:
    """(compute ms, memory ms) of a layer at 100% of the target's peak and bandwidth."""
    peak_tera = {"int8": target.int8_tops, "fp16": target.fp16_tflops, "fp32": target.fp32_tflops}[precision]
    if peak_tera <= 0 or target.memory_bandwidth_gbs <= 0:
        raise ValueError(f"target has no {precision} peak or bandwidth; it cannot be predicted")
    return flops / (peak_tera * 1e12) * 1e3, nbytes / (target.memory_bandwidth_gbs * 1e9) * 1e3


class Workload:
    """A prediction reduced to what the efficiencies act on: per layer its ideal compute and memory
    times and its (kind, precision) class. `total_ms(efficiency)` re-prices it in microseconds of
    Python, which is what fitting and leave-one-out need (hundreds of evaluations per reference)."""

    def __init__(self, prediction: Prediction, target):
        layers = prediction.layers
        ideal = np.array([ideal_times(l.precision, l.flops, l.bytes, target) for l in layers]).reshape(-1, 2)
        self.compute_ms, self.memory_ms = ideal[:, 0], ideal[:, 1]
        self.l2_ms = np.array([ideal_times(l.precision, 0, l.l2_bytes, target)[1] for l in layers])
        self.kinds = [(l.kind, l.precision) for l in layers]
        self.classes = sorted(set(self.kinds))
        self.index = np.array([self.classes.index(k) for k in self.kinds], dtype=int)

    def total_ms(self, efficiency: Efficiency) -> float:
        compute = np.array([efficiency.compute(k, p) for k, p in self.classes] or [1.0])[self.index]
        memory = np.array([efficiency.bandwidth(k) for k, _ in self.classes] or [1.0])[self.index]
        times = np.maximum(self.compute_ms / compute, self.memory_ms / memory + self.l2_ms / efficiency.gather)
        return float(times.sum() + len(self.kinds) * efficiency.launch_us * 1e-3)

    def share_by_kind(self, efficiency: Efficiency) -> dict:
        """Predicted ms per operator class (launch overhead included), for the per-class breakdown."""
        out: dict = {}
        for (kind, precision), c, m, l2 in zip(self.kinds, self.compute_ms, self.memory_ms, self.l2_ms):
            t = max(c / efficiency.compute(kind, precision), m / efficiency.bandwidth(kind) + l2 / efficiency.gather)
            t += efficiency.launch_us * 1e-3
            out[kind] = out.get(kind, 0.0) + float(t)
        return out
