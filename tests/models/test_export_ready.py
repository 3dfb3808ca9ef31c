"""The network is export-friendly: with the rig's geometry baked in it traces to standard ONNX
and ONNX Runtime reproduces every named output."""

import warnings

import numpy as np
import pytest
import torch

from stack.config import load_pipeline
from stack.models import build_model
from stack.models.outputs import output_names
from stack.synthetic_batch import random_batch


class NamedOutputs(torch.nn.Module):
    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, images, ego_status, command):
        outputs = self.model(images, ego_status, command)
        return tuple(outputs[name] for name in self.names)


@pytest.mark.slow
@pytest.mark.parametrize("planner", [[], ["model.planning_accelerations=[-7,-3,0,1.5]"]],
                         ids=["regression", "path_speed"])
def test_fixed_rig_model_exports_to_onnx_with_parity(tmp_path, planner):
    import onnx
    import onnxruntime

    warnings.filterwarnings("ignore")
    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"], planner)
    model = build_model(pipeline).eval()
    model.fix_geometry(model.rig_geometry(batch=1))
    batch = random_batch(pipeline, batch_size=1, seed=2)
    names = output_names(pipeline.model)
    assert "attribute_logits" in names  # the tiny preset's attribute head is part of the graph
    wrapper = NamedOutputs(model, names).eval()
    inputs = (batch.images, batch.ego_status, batch.command)
    with torch.no_grad():
        expected = wrapper(*inputs)
    path = tmp_path / "tiny.onnx"
    torch.onnx.export(wrapper, inputs, str(path), input_names=["images", "ego_status", "command"],
                      output_names=names, opset_version=pipeline.export.opset, dynamo=False)
    graph = onnx.load(str(path)).graph
    assert not {n.op_type for n in graph.node} & {"ScatterND", "ScatterElements"}  # TensorRT-hostile
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": batch.images.numpy(), "ego_status": batch.ego_status.numpy(),
                             "command": batch.command.numpy()})
    for name, ours, theirs in zip(names, expected, got):
        np.testing.assert_allclose(theirs, ours.numpy(), atol=pipeline.export.parity_atol, rtol=1e-3, err_msg=name)


@pytest.mark.slow
def test_deploy_export_keeps_its_three_inputs_and_the_unrotated_plan(tmp_path):
    """The BEV-augmentation angle is a training input only: the deployed graph must not gain it, and its plan
    is the planner's plan at rotation 0."""
    import onnx
    import onnxruntime

    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network

    warnings.filterwarnings("ignore")
    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"], ["export.batch_size=1"])
    torch.manual_seed(3)
    model = build_model(pipeline).eval()
    with torch.no_grad():
        model.planning_head.rotation.weight.normal_()  # a trained head: the angle matters to its ego query
        model.planning_head.waypoints.weight.normal_(std=0.05)
    exportable = export_network(pipeline, model.state_dict())
    path = tmp_path / "tiny.onnx"
    export_onnx(exportable.net, exportable.example, exportable.output_names, path, pipeline.export.opset,
                exportable.metadata)
    assert [i.name for i in onnx.load(str(path)).graph.input] == ["images", "ego_status", "command"]
    batch = random_batch(pipeline, batch_size=1, seed=2)
    with torch.no_grad():
        expected = model.forward_batch(batch)  # bev_rotation zeros, geometry of the nominal rig
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = dict(zip(exportable.output_names, session.run(None, {"images": batch.images.numpy(),
                                                               "ego_status": batch.ego_status.numpy(),
                                                               "command": batch.command.numpy()})))
    for name in ("plan_trajectories", "plan_scores"):
        np.testing.assert_allclose(got[name], expected[name].numpy(), atol=pipeline.export.parity_atol, rtol=1e-3,
                                   err_msg=name)
