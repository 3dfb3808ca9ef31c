"""INT8 by explicit quantization: QDQ ONNX in the form the target's runtime wants.

The QDQ flavour is a property of the target, not a global switch:

- `tensorrt`: symmetric signed INT8 activations and per-channel symmetric INT8 weights,
  every zero point 0, biases left in float (`QuantizeBias` false). TensorRT's explicit
  quantization rejects nonzero zero points and quantizes biases itself. Q/DQ go where
  TensorRT's explicit-quantization guidance ("Q/DQ layer-placement recommendations" in
  the TensorRT developer guide) and NVIDIA Model Optimizer's ONNX PTQ put them: on the
  inputs of weighted layers (Conv, ConvTranspose, MatMul, Gemm) and on both inputs of
  residual Adds (two activation inputs), which TensorRT fuses into the convolution that
  produces one of them. Pointwise ops, pooling, resizing and concatenations get no Q/DQ of
  their own: TensorRT fuses or propagates through them, and a Q/DQ pair there would force
  an INT8 boundary the engine does not want.
- `onnxruntime-cpu`: unsigned INT8 activations (asymmetric, nonzero zero points) with
  signed per-channel weights, the U8S8 form ONNX Runtime's CPU kernels run fastest
  (1.07x-1.39x fp32 on an EPYC with VNNI, slower than fp32 on an AVX2 EPYC without it:
  docs/results/deploy.md, "INT8 on the tiny recipe"; symmetric S8S8 gave no CPU speed-up,
  docs/log/2026-11-23_fp32-vs-int8-onnxruntime.md). Weights use 7
  bits (`reduce_range`): on x86 CPUs without VNNI the U8S8 kernels add pairs of u8·s8
  products in 16 bits, which full-range weights overflow. On such a CPU (AVX2 EPYC) 8-bit
  weights cost the tiny network's depth head 0.014 AbsRel, over its 0.01 budget, whatever
  layers stayed fp32; the bundle also runs on CPUs other than the one that built it.

Calibration is MinMax over validation samples through `onnxruntime.quantization
.quantize_static`; its ranges are cached as JSON next to the QDQ model, which is both
the bundle's calibration reference and what lets the accuracy gate re-quantize with
different fp32 exclusions without re-running calibration. Nodes whose names contain a
`keep_fp32` pattern (the BEV pooling's gathers and matmuls) are never quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import onnx

from stack.errors import StackError

QUANTIZED_WEIGHT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
"""Operators whose weights are quantized: the layers the accuracy gate may keep in fp32."""
TENSORRT_QDQ_OPS = QUANTIZED_WEIGHT_OPS + ("Add",)
"""Operators whose inputs get Q/DQ in the `tensorrt` flavour (Adds only when residual: `non_residual_adds`)."""


class CalibrationError(StackError):
    """The calibration data cannot calibrate the model."""


def flavour_options(flavour: str) -> dict:
    """`quantize_static` keyword arguments for a target's QDQ flavour."""
    from onnxruntime.quantization import QuantFormat, QuantType

    if flavour == "tensorrt":
        activation, seven_bit = QuantType.QInt8, False
        extra = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False,
                 "OpTypesToExcludeOutputQuantization": list(TENSORRT_QDQ_OPS)}
    elif flavour == "onnxruntime-cpu":
        activation, seven_bit = QuantType.QUInt8, True
        extra = {"ActivationSymmetric": False, "WeightSymmetric": True}
    else:
        raise StackError(f"QDQ flavour {flavour!r} cannot quantize; expected 'tensorrt' or 'onnxruntime-cpu'. "
                         f"Set the target's qdq_flavour, or precision: fp16/fp32 for no INT8.")
    return {"quant_format": QuantFormat.QDQ, "activation_type": activation, "weight_type": QuantType.QInt8,
            "per_channel": True, "reduce_range": seven_bit, "extra_options": extra}


class SampleReader:
    """A `CalibrationDataReader` over a list of feed dicts (input name -> numpy array)."""

    def __init__(self, samples: list[dict]):
        self.samples = list(samples)
        self._iterator = iter(self.samples)

    def get_next(self):
        return next(self._iterator, None)

    def rewind(self) -> None:
        self._iterator = iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)


def check_calibration_set(samples: list, needed: int, what: str = "export.calibration_samples") -> None:
    """Refuse a calibration set smaller than `needed`: ranges from a handful of frames are noise."""
    if len(samples) < needed:
        raise CalibrationError(
            f"calibration set too small: {what} asks for {needed} validation samples, found {len(samples)}. "
            f"Render more validation data (data.world.scenes / data.world.val_fraction) or lower {what}."
        )


def weight_layers(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes that carry quantizable weights (initializer second input), in graph order."""
    constants = {init.name for init in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in QUANTIZED_WEIGHT_OPS
            and len(n.input) > 1 and n.input[1] in constants]


def fp32_nodes(model: onnx.ModelProto, patterns: Iterable[str]) -> list[str]:
    """Names of the nodes that stay in fp32 because they match a `keep_fp32` pattern."""
    patterns = [p for p in patterns if p]
    return [n.name for n in model.graph.node if any(p in n.name for p in patterns)]


@dataclass
class QuantizeResult:
    path: Path
    flavour: str
    kept_fp32: list = field(default_factory=list)
    """Nodes kept in fp32 by name pattern (BEV pooling)."""
    excluded: list = field(default_factory=list)
    """Layers kept in fp32 by the accuracy gate."""


def quantize(fp32_path: str | Path, out_path: str | Path, flavour: str, samples: list[dict] | None,
             cache_path: str | Path, keep_fp32: Iterable[str] = (), exclude: Iterable[str] = ()) -> QuantizeResult:
    """Write the QDQ model of `fp32_path` for `flavour`, calibrated on `samples` (or the cache).

    `samples` may be None when `cache_path` already holds the ranges of this model.
    """
    from onnxruntime.quantization import quantize_static

    model = onnx.load(str(fp32_path))
    kept = fp32_nodes(model, keep_fp32)
    excluded = [name for name in exclude if name not in kept]
    placement, unquantized = {}, kept + excluded
    if flavour == "tensorrt":
        placement = {"op_types_to_quantize": list(TENSORRT_QDQ_OPS)}
        unquantized += [name for name in non_residual_adds(model) if name not in unquantized]
    out_path, cache_path = Path(out_path), Path(cache_path)
    if samples is None and not cache_path.is_file():
        raise CalibrationError(f"no calibration samples and no calibration cache at {cache_path}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # quantize_static logs a pre-processing hint on every call
    try:
        quantize_static(str(fp32_path), str(out_path), SampleReader(samples) if samples is not None else None,
                        nodes_to_exclude=unquantized, calibration_cache_path=str(cache_path),
                        **placement, **flavour_options(flavour))
    finally:
        logging.getLogger().setLevel(quiet)
    if flavour == "tensorrt":
        qdq = onnx.load(str(out_path))
        unhook_qdq_consumers(qdq, set(unquantized))
        onnx.save(qdq, str(out_path))
    return QuantizeResult(out_path, flavour, kept, excluded)


def unhook_qdq_consumers(model: onnx.ModelProto, unquantized: set[str]) -> None:
    """Feed every node that should not see INT8 from the float tensor, not from a Q/DQ pair it shares.

    `quantize_static` puts one Q/DQ pair on a tensor and hands its output to every consumer,
    so a pooling or pointwise node that shares its input with a Conv would read the
    quantized value: not what the `tensorrt` placement means. Such consumers (any op
    outside `TENSORRT_QDQ_OPS`, and the nodes in `unquantized`) are rewired to the tensor
    before the QuantizeLinear; pairs that no longer feed anything are removed.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.op_type in TENSORRT_QDQ_OPS and node.name not in unquantized:
            continue
        for index, name in enumerate(node.input):
            dequantize = producers.get(name)
            quantize_node = producers.get(dequantize.input[0]) if dequantize is not None else None
            if dequantize is not None and dequantize.op_type == "DequantizeLinear" and \
                    quantize_node is not None and quantize_node.op_type == "QuantizeLinear":
                node.input[index] = quantize_node.input[0]
    _drop_unused_qdq(model)


def _drop_unused_qdq(model: onnx.ModelProto) -> None:
    outputs = {o.name for o in model.graph.output}
    while True:
        used = {name for node in model.graph.node for name in node.input} | outputs
        dead = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(out in used for out in n.output)]
        if not dead:
            return
        for node in dead:
            model.graph.node.remove(node)


def non_residual_adds(model: onnx.ModelProto) -> list[str]:
    """Adds with a constant input (a bias, an offset): not residual joins, so no Q/DQ in the `tensorrt` flavour."""
    constants = {init.name for init in model.graph.initializer}
    constants |= {out for node in model.graph.node if node.op_type == "Constant" for out in node.output}
    return [n.name for n in model.graph.node if n.op_type == "Add" and any(i in constants for i in n.input)]


def quantized_layers(model: onnx.ModelProto) -> list[str]:
    """Weight layers of a QDQ model whose weight arrives through a DequantizeLinear."""
    producers = {out: node for node in model.graph.node for out in node.output}
    found = []
    for node in model.graph.node:
        if node.op_type in QUANTIZED_WEIGHT_OPS and len(node.input) > 1:
            producer = producers.get(node.input[1])
            if producer is not None and producer.op_type == "DequantizeLinear":
                found.append(node.name)
    return found


DATA_MOVEMENT_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Split", "Gather",
                     "GatherElements", "Pad", "Where", "TopK", "CumSum"}
"""Ops the quantizer wraps only to carry scales through; never worth keeping in fp32 on their own."""


def quantizable_nodes(model: onnx.ModelProto, keep_fp32: Iterable[str] = (), flavour: str = "onnxruntime-cpu") -> list[str]:
    """Nodes the flavour quantizes (their own Q/DQ): the accuracy gate's candidates for keeping in fp32.

    `tensorrt`: weighted layers and residual Adds; `onnxruntime-cpu`: whatever `quantize_static`
    wraps, minus data movement. Kept-fp32 nodes are never candidates.
    """
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    kept = set(fp32_nodes(model, keep_fp32))
    if flavour == "tensorrt":
        skip = kept | set(non_residual_adds(model))
        return [n.name for n in model.graph.node if n.op_type in TENSORRT_QDQ_OPS and n.name not in skip]
    kinds = (set(QDQRegistry) | set(QLinearOpsRegistry)) - DATA_MOVEMENT_OPS
    return [n.name for n in model.graph.node if n.op_type in kinds and n.name not in kept]
