"""ONNX export of a network with named outputs, checked before anything else trusts it.

`export_onnx` writes the graph with the legacy TorchScript exporter (`dynamo=False`),
then folds its static shape arithmetic (onnxscript's optimizer):
its constant folding folds eval-mode BatchNorm into Conv weights (what TensorRT and
ONNX Runtime would do anyway, and what the latency model assumes), and it names every
node after its module path (`/view_transform/bev_pool/MatMul`), which is how the
quantizer keeps BEV pooling in fp32 by name. The file carries its metadata
(`metadata_props`: pipeline hash, class names, output layout, rig, normalisation) so a
runtime never guesses, and passes `onnx.checker` with `full_check`.

`check_parity` runs ONNX Runtime and PyTorch on the same inputs and reports the
largest error per output against a stated tolerance.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from stack.deploy.trt_ops import op_counts, tensorrt_problems
from stack.errors import StackError


class ExportError(StackError):
    """The network could not be exported, or the exported graph is not faithful."""


class _NamedOutputs(torch.nn.Module):
    """Calls a network with keyword inputs and returns its dict outputs as a tuple in a fixed order."""

    def __init__(self, net: torch.nn.Module, input_names: list[str], output_names: list[str]):
        super().__init__()
        self.net, self.input_names, self.output_names = net, input_names, output_names

    def forward(self, *inputs):
        outputs = self.net(**dict(zip(self.input_names, inputs)))
        missing = [name for name in self.output_names if name not in outputs]
        if missing:
            raise ExportError(f"the network returned outputs {sorted(outputs)}; expected {self.output_names}")
        return tuple(outputs[name] for name in self.output_names)


@dataclass
class ExportResult:
    path: Path
    ops: dict
    """Operator type -> node count."""
    tensorrt_problems: list
    """Why TensorRT could not import the graph natively (empty when it can)."""


def export_onnx(net: torch.nn.Module, inputs: dict, output_names: list[str], path: str | Path,
                opset: int, metadata: dict) -> ExportResult:
    """Export `net(**inputs) -> {name: tensor}` to `path` with named inputs/outputs and metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = _NamedOutputs(net.eval(), list(inputs), list(output_names)).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice; see the module docstring
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        torch.onnx.export(wrapper, tuple(inputs.values()), str(path), input_names=list(inputs),
                          output_names=list(output_names), opset_version=opset, dynamo=False,
                          do_constant_folding=True)
    model = _fold_static_shapes(onnx.load(str(path)))
    set_metadata(model, metadata)
    onnx.save(model, str(path))
    check_model(path)
    return ExportResult(path, op_counts(model), tensorrt_problems(model))


def _fold_static_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant-fold the shape arithmetic a static graph does not need (Shape/Gather/Mod chains).

    The TorchScript exporter records `x.unflatten(0, (batch, cameras))` as runtime shape
    math, including `Mod`, which TensorRT 8.6 cannot import; with static shapes it all
    folds to constants (onnxscript's optimizer), roughly halving the node count.
    """
    import onnxscript.optimizer

    model = onnxscript.optimizer.optimize(model)
    _restore_scoped_names(model)
    return model


def _restore_scoped_names(model: onnx.ModelProto) -> None:
    """Name nodes the optimizer renamed (`node_Conv_44`) after their module-scoped output tensor.

    Names carry the module path (`/net/image_encoder/backbone/conv1/Conv`), which reports,
    sensitivity tables and `export.keep_fp32` patterns rely on.
    """
    taken = {node.name for node in model.graph.node}
    for node in model.graph.node:
        output = node.output[0] if node.output else ""
        if node.name.startswith("node_") and output.startswith("/") and output.endswith("_output_0"):
            scoped = output[: -len("_output_0")]
            if scoped not in taken:
                taken.add(scoped)
                node.name = scoped


def set_metadata(model: onnx.ModelProto, metadata: dict) -> None:
    """Store `metadata` in `metadata_props`; non-string values are written as JSON."""
    del model.metadata_props[:]
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value)


def read_metadata(path: str | Path) -> dict:
    """The `metadata_props` of an ONNX file, JSON values decoded by the bounded reader (the file may be a user's):
    an object or array it refuses (too deep, a number out of range) is a StackError naming the key; any other
    value that is not JSON stays text."""
    from stack.errors import StackError
    from stack.safe_values import escaped
    from stack.user_json import parse_json

    decoded = {}
    for entry in onnx.load(str(path), load_external_data=False).metadata_props:
        structured = entry.value.lstrip()[:1] in ("{", "[")
        try:
            decoded[entry.key] = parse_json(entry.value, f"{escaped(str(path))} metadata {escaped(repr(entry.key))}", "a JSON value",
                                            "Export the network again (`stack export`).", expect=object, infinity=True)
        except StackError:
            if structured:
                raise
            decoded[entry.key] = entry.value
    return decoded


def check_model(path: str | Path) -> None:
    """`onnx.checker` with full shape/type inference, as an `ExportError`."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{path} fails onnx.checker (full check): {str(exc)[:400]}") from None


@dataclass
class ParityRow:
    output: str
    max_abs_error: float
    max_abs_value: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.tolerance


def check_parity(net: torch.nn.Module, path: str | Path, samples: list[dict], output_names: list[str],
                 atol: float, rtol: float = 1e-3) -> list[ParityRow]:
    """Largest |ONNX Runtime - PyTorch| per output over `samples` (numpy feeds).

    The tolerance of an output is `atol + rtol * max|PyTorch output|`, so logits in the
    hundreds and offsets near zero are both judged fairly.
    """
    from stack.deploy.runtime import ort_session
    from stack.deploy.stateful import memory_shape, with_memory

    session = ort_session(path)
    shape = memory_shape(session)
    errors = {name: 0.0 for name in output_names}
    peaks = {name: 0.0 for name in output_names}
    with torch.no_grad():
        for feeds in samples:
            if shape is not None:  # a stateful graph: both sides fuse the memory PyTorch made of the frame before
                feeds = with_memory(feeds, torch_runner(net), shape)
            expected = net.eval()(**{k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()})
            got = dict(zip(output_names, session.run(output_names, feeds)))
            for name in output_names:
                reference = expected[name].float().numpy()
                errors[name] = max(errors[name], float(np.abs(got[name] - reference).max(initial=0.0)))
                peaks[name] = max(peaks[name], float(np.abs(reference).max(initial=0.0)))
    return [ParityRow(name, errors[name], peaks[name], atol + rtol * peaks[name]) for name in output_names]


def torch_runner(net: torch.nn.Module):
    """`net` (keyword tensors -> {name: tensor}) on numpy feeds, numpy out: a `stateful.with_memory` run."""
    def run(feeds: dict) -> dict:
        with torch.no_grad():
            outputs = net.eval()(**{k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()})
        return {k: v.float().numpy() for k, v in outputs.items()}
    return run


def with_reference_memory(feeds: dict, net: torch.nn.Module, example: dict) -> dict:
    """`feeds` as graph inputs: a stateful graph's frame pair (`stateful.PREVIOUS_IMAGES`) gets the memory the PyTorch
    network `net` made of the frame before, for uses that need one fixed input rather than each model's own memory
    (INT8 calibration ranges, sensitivity screening, timing, engine comparisons). `example`: the graph's example
    inputs (their previous_bev gives the memory's shape); feeds of a one-frame graph pass unchanged."""
    from stack.deploy.stateful import STATE_INPUTS, with_memory

    if STATE_INPUTS[0] not in example:
        return feeds
    return with_memory(feeds, torch_runner(net), tuple(example[STATE_INPUTS[0]].shape))
