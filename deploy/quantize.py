"""INT8 by explicit quantization: QDQ ONNX in the form the target's runtime wants.

The QDQ flavour is a property of the target, not a global switch:

- `tensorrt`: symmetric signed INT8 activations and per-channel symmetric INT8 weights,
  every zero point 0, biases left in float (`QuantizeBias` false). TensorRT's explicit
  quantization rejects nonzero zero points and quantizes biases itself.
- `onnxruntime-cpu`: unsigned INT8 activations (asymmetric, nonzero zero points) with
  signed per-channel weights, the U8S8 form ONNX Runtime's CPU kernels run fastest
  (measured here about 2.5x over fp32; symmetric S8S8 gave no CPU speed-up). Weights use 7
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


class CalibrationError(StackError):
    """The calibration data cannot calibrate the model."""


def flavour_options(flavour: str) -> dict:
    """`quantize_static` keyword arguments for a target's QDQ flavour."""
    from onnxruntime.quantization import QuantFormat, QuantType

    if flavour == "tensorrt":
        activation, seven_bit = QuantType.QInt8, False
        extra = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}
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
    out_path, cache_path = Path(out_path), Path(cache_path)
    if samples is None and not cache_path.is_file():
        raise CalibrationError(f"no calibration samples and no calibration cache at {cache_path}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # quantize_static logs a pre-processing hint on every call
    try:
        quantize_static(str(fp32_path), str(out_path), SampleReader(samples) if samples is not None else None,
                        nodes_to_exclude=kept + excluded, calibration_cache_path=str(cache_path),
                        **flavour_options(flavour))
    finally:
        logging.getLogger().setLevel(quiet)
    return QuantizeResult(out_path, flavour, kept, excluded)


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


def quantizable_nodes(model: onnx.ModelProto, keep_fp32: Iterable[str] = ()) -> list[str]:
    """Nodes `quantize_static` would quantize (their own Q/DQ), minus data movement and kept-fp32 nodes."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    kinds = (set(QDQRegistry) | set(QLinearOpsRegistry)) - DATA_MOVEMENT_OPS
    kept = set(fp32_nodes(model, keep_fp32))
    return [n.name for n in model.graph.node if n.op_type in kinds and n.name not in kept]
