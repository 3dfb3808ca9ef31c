"""A temporal network (model.temporal_frames=1; 2) exported as a stateful graph: the BEV memory of the key frame 0.5 s
earlier is an input and the frame's own an output; ONNX Runtime matches PyTorch given the same memory;
`DeployedNetwork` carries the memory between frames, fuses it only at the trained period and starts a sequence
otherwise; the deploy gates score frame pairs, each runtime on its own memory."""

import warnings

import numpy as np
import pytest
import torch

from stack.config import load_pipeline
from stack.deploy.export import check_parity, export_onnx, read_metadata, torch_runner
from stack.deploy.exportable import INPUTS, batch_feeds, export_network
from stack.deploy.runner import DeployedNetwork
from stack.deploy.stateful import MEMORY_OUTPUT, STATE_INPUTS, with_memory
from stack.errors import StackError
from stack.models import build_model
from stack.synthetic_batch import random_batch

TINY = ["configs/pipeline.yaml", "configs/presets/tiny.yaml"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY, ["model.temporal_frames=1", "export.batch_size=1"])
    network = export_network(pipeline, build_model(pipeline).state_dict())
    path = tmp_path_factory.mktemp("stateful") / "model.onnx"
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    return pipeline, network, path


def _frame(pipeline, seed):
    return batch_feeds(random_batch(pipeline, batch_size=1, seed=seed))[0]


def test_the_graph_takes_the_memory_and_returns_the_next_one_as_pytorch_does(exported):
    import onnx

    pipeline, network, path = exported
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == list(INPUTS) + list(STATE_INPUTS)
    assert [o.name for o in graph.output][-1] == MEMORY_OUTPUT
    assert read_metadata(path)["state"]["period_s"] == 0.5
    shape = tuple(network.example[STATE_INPUTS[0]].shape)
    feeds = [with_memory(_frame(pipeline, seed), torch_runner(network.net), shape) for seed in (1, 2)]
    assert all(f[STATE_INPUTS[2]][0] == 1.0 and float(np.abs(f[STATE_INPUTS[0]]).max()) > 0 for f in feeds)
    rows = check_parity(network.net, path, feeds, network.output_names, pipeline.export.parity_atol,
                        pipeline.export.parity_rtol)
    assert all(row.passed for row in rows), [r for r in rows if not r.passed]
    assert MEMORY_OUTPUT in {row.output for row in rows}


def test_a_path_speed_planner_that_reads_detected_velocities_exports_as_pytorch_plans(tmp_path):
    """model.planning_velocity: the scorer reads the detection head's velocity along each candidate's path
    (pooling, a division, grid_sample): the deployed graph plans what PyTorch plans."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY + ["configs/presets/tiny-drive.yaml"],
                             ["model.temporal_frames=1", "model.planning_velocity=true", "export.batch_size=1"])
    model = build_model(pipeline)
    with torch.no_grad():  # a scorer that reads the velocity features, not the zeros of an untrained head
        model.planning_head.sample_projection.weight[:, -2:].normal_(std=1.0)
        model.detection_head.regression[-1].bias[8:10] = torch.tensor([3.0, -1.0])
    network = export_network(pipeline, model.state_dict())
    path = tmp_path / "model.onnx"
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    shape = tuple(network.example[STATE_INPUTS[0]].shape)
    feeds = [with_memory(_frame(pipeline, seed), torch_runner(network.net), shape) for seed in (1, 2)]
    rows = check_parity(network.net, path, feeds, network.output_names, pipeline.export.parity_atol,
                        pipeline.export.parity_rtol)
    assert all(row.passed for row in rows), [r for r in rows if not r.passed]
    assert "plan_scores" in {row.output for row in rows}


def test_a_pre_encoded_memory_exports_as_pytorch_computes_it(tmp_path):
    """model.temporal_pre_blocks: the memory is the BEV pre-encoder's output; the graph returns and fuses the same
    memory PyTorch does, with the shape the deployed runner allocates."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY, ["model.temporal_frames=1", "model.temporal_pre_blocks=2", "export.batch_size=1"])
    network = export_network(pipeline, build_model(pipeline).state_dict())
    path = tmp_path / "model.onnx"
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    shape = tuple(network.example[STATE_INPUTS[0]].shape)
    assert shape == (1, pipeline.model.neck_channels, 64, 64)
    feeds = [with_memory(_frame(pipeline, seed), torch_runner(network.net), shape) for seed in (1, 2)]
    rows = check_parity(network.net, path, feeds, network.output_names, pipeline.export.parity_atol,
                        pipeline.export.parity_rtol)
    assert all(row.passed for row in rows), [r for r in rows if not r.passed]
    assert {MEMORY_OUTPUT, "heatmap"} <= {row.output for row in rows}


def test_a_memory_of_two_key_frames_exports_and_three_frames_score_the_newest_as_pytorch_does(tmp_path):
    """model.temporal_frames=2: the graph's memory is two BEVs wide; a feed with the two frames before (the
    loader's previous and earlier images) is resolved oldest first by the runtime itself, and the graph's outputs
    match the PyTorch network's on the window it trained on (`forward_batch`)."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY, ["model.temporal_frames=2", "export.batch_size=1"])
    model = build_model(pipeline)
    network = export_network(pipeline, model.state_dict())
    path = tmp_path / "model.onnx"
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    shape = tuple(network.example[STATE_INPUTS[0]].shape)
    assert shape == (1, 2 * pipeline.model.neck_channels, 64, 64)
    assert "2 BEV(s)" in read_metadata(path)["state_inputs"]["previous_bev"]
    batch = random_batch(pipeline, batch_size=1, seed=1)
    feeds = [with_memory(batch_feeds(batch)[0], torch_runner(network.net), shape)]
    rows = check_parity(network.net, path, feeds, network.output_names, pipeline.export.parity_atol,
                        pipeline.export.parity_rtol)
    assert all(row.passed for row in rows), [r for r in rows if not r.passed]
    from stack.deploy.gates.accuracy import session_runner

    graph = session_runner(path)(batch_feeds(batch)[0])
    with torch.no_grad():
        window = model.eval().forward_batch(batch)
    np.testing.assert_allclose(graph["heatmap"], window["heatmap"].numpy(), atol=pipeline.export.parity_atol,
                               rtol=1e-3)


def test_previous_valid_zero_is_the_sequence_start_and_one_fuses_the_memory(exported):
    pipeline, network, path = exported
    from stack.deploy.runtime import ort_session

    session = ort_session(path)
    names = network.output_names
    feed = with_memory(_frame(pipeline, 3), torch_runner(network.net), tuple(network.example[STATE_INPUTS[0]].shape))
    fused = dict(zip(names, session.run(names, feed)))
    start = dict(zip(names, session.run(names, {**feed, STATE_INPUTS[2]: np.zeros(1, np.float32)})))
    garbage = {**feed, STATE_INPUTS[0]: np.full_like(feed[STATE_INPUTS[0]], 1e6), STATE_INPUTS[2]: np.zeros(1, np.float32)}
    ignored = dict(zip(names, session.run(names, garbage)))
    with torch.no_grad():
        alone = network.net.net(*(torch.from_numpy(feed[k]) for k in INPUTS), None, None, None, None)
    np.testing.assert_allclose(start["heatmap"], alone["heatmap"].numpy(), atol=pipeline.export.parity_atol, rtol=1e-3)
    np.testing.assert_array_equal(start["heatmap"], ignored["heatmap"])  # valid 0: the memory input is not read
    assert not np.allclose(fused["heatmap"], start["heatmap"], atol=1e-4)


def test_the_deployed_network_fuses_only_the_memory_of_the_trained_period(exported):
    pipeline, network, path = exported
    net = DeployedNetwork.from_model(path)
    assert net.state["memory_output"] == MEMORY_OUTPUT
    frames = [_frame(pipeline, seed) for seed in (4, 5, 6, 7)]
    pose = np.array([[-2.0, 0.1, 0.05]], np.float32)

    def infer(frame, time_s):
        return net.infer(frame["images"], frame["ego_status"], frame["command"], network.calibration,
                         time_s=time_s, previous_pose=pose)

    with pytest.raises(StackError, match="time_s"):
        net.infer(frames[0]["images"], frames[0]["ego_status"], frames[0]["command"], network.calibration)
    with pytest.raises(StackError, match="finite number"):
        infer(frames[0], "10.0")
    first = infer(frames[0], 10.0)
    assert not net.fused_memory
    second = infer(frames[1], np.float32(10.5))  # numpy scalars are times too
    assert net.fused_memory
    replay = network.net(**{k: torch.from_numpy(v) for k, v in {
        **{k: frames[1][k] for k in INPUTS}, STATE_INPUTS[0]: first[MEMORY_OUTPUT], STATE_INPUTS[1]: pose,
        STATE_INPUTS[2]: np.ones(1, np.float32)}.items()})
    np.testing.assert_allclose(second["plan_scores"], replay["plan_scores"].detach().numpy(),
                               atol=pipeline.export.parity_atol, rtol=1e-3)
    infer(frames[2], 10.8)  # 0.3 s after the last frame, 0.8 s after the one before: no memory of 0.5 s age
    assert not net.fused_memory
    infer(frames[3], 11.3)  # 0.5 s after 10.8
    assert net.fused_memory
    with pytest.raises(StackError, match="time order"):
        infer(frames[0], 11.0)
    net.reset()
    infer(frames[0], 11.8)  # 0.5 s after 11.3, but reset forgot it: a new scene
    assert not net.fused_memory


def test_each_runtime_the_gates_score_fuses_the_memory_it_made_itself(exported):
    """The accuracy gate's runner resolves a frame pair with its own model: INT8's memory errors reach INT8's
    scores, as they would on the road; calibration and timing feeds get the PyTorch network's memory instead."""
    from stack.deploy.entrypoints import calibration_feeds
    from stack.deploy.gates.accuracy import session_runner
    from stack.deploy.runtime import ort_session

    pipeline, network, path = exported
    pair = _frame(pipeline, 8)
    got = session_runner(path)(pair)
    session = ort_session(path)
    names = [o.name for o in session.get_outputs()]
    shape = tuple(network.example[STATE_INPUTS[0]].shape)
    start = {"images": pair["previous_images"], "ego_status": pair["ego_status"], "command": pair["command"],
             STATE_INPUTS[0]: np.zeros(shape, np.float32), STATE_INPUTS[1]: np.zeros((1, 3), np.float32),
             STATE_INPUTS[2]: np.zeros(1, np.float32)}
    memory = dict(zip(names, session.run(names, start)))[MEMORY_OUTPUT]
    by_hand = dict(zip(names, session.run(names, {**{k: pair[k] for k in INPUTS}, STATE_INPUTS[0]: memory,
                                                   STATE_INPUTS[1]: pair[STATE_INPUTS[1]],
                                                   STATE_INPUTS[2]: np.ones(1, np.float32)})))
    np.testing.assert_array_equal(got["heatmap"], by_hand["heatmap"])
    [calibration] = calibration_feeds(network, network.net, [pair])
    assert set(calibration) == set(INPUTS) | set(STATE_INPUTS)
    np.testing.assert_allclose(calibration[STATE_INPUTS[0]], memory, atol=pipeline.export.parity_atol, rtol=1e-3)


def _with_memory_quantized(path, out, scale: float):
    """`path` with its memory output passed through an INT8 quantize/dequantize pair of the given scale: a memory
    whose calibrated range is wrong (values beyond 127 x scale saturate), the rest of the graph untouched."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path))
    graph = model.graph
    for node in graph.node:  # the tensor keeps feeding this frame's heads; only the graph output is quantized
        for names in (node.input, node.output):
            for index, name in enumerate(names):
                if name == MEMORY_OUTPUT:
                    names[index] = "bev_memory_fp32"
    graph.initializer.extend([helper.make_tensor("memory_scale", TensorProto.FLOAT, [], [scale]),
                              helper.make_tensor("memory_zero", TensorProto.INT8, [], [0])])
    graph.node.extend([
        helper.make_node("QuantizeLinear", ["bev_memory_fp32", "memory_scale", "memory_zero"], ["bev_memory_int8"]),
        helper.make_node("DequantizeLinear", ["bev_memory_int8", "memory_scale", "memory_zero"], [MEMORY_OUTPUT])])
    onnx.save(model, str(out))
    return out


def test_a_graph_whose_int8_memory_is_broken_fails_the_accuracy_gate(exported, tmp_path):
    """The accuracy gate judges a stateful graph on frame pairs, each model fusing the memory it made itself: an
    INT8 graph that is exact on every single frame but saturates its memory fails, and the same graph with a
    memory scale that covers the range passes; fed the reference network's memory, the broken graph looks sound."""
    from stack.deploy.gates.accuracy import HeadBudget, accuracy_gate, frame_means, session_runner
    from stack.deploy.runtime import ort_session

    pipeline, network, path = exported
    pairs = [_frame(pipeline, seed) for seed in (10, 11, 12, 13)]
    reference = [session_runner(path)(pair) for pair in pairs]
    head, budget = "heatmap", 0.05  # detection reads the BEV, where the memory is fused

    def evaluate(run):
        return frame_means([{"heatmap_error": float(np.linalg.norm(run(pair)[head] - expected[head])
                                                    / np.linalg.norm(expected[head]))}
                            for pair, expected in zip(pairs, reference)])

    memory = reference[0][MEMORY_OUTPUT]
    broken = _with_memory_quantized(path, tmp_path / "broken.onnx", scale=float(np.abs(memory).max()) / 127 / 50)
    sound = _with_memory_quantized(path, tmp_path / "sound.onnx", scale=float(np.abs(memory).max()) / 127 * 2)

    start = {**{k: pairs[0][k] for k in INPUTS}, **{k: np.zeros(network.example[k].shape, np.float32)
                                                      for k in STATE_INPUTS}}
    one_frame, alone = (ort_session(graph).run([head], start)[0] for graph in (broken, path))
    np.testing.assert_array_equal(one_frame, alone)  # on a sequence start the two graphs are one

    def gate(graph):
        return accuracy_gate(path, lambda excluded: graph, evaluate, [HeadBudget(head, "heatmap_error", budget, False)],
                             [], [], max_fp32_layers=0, log=lambda message: None)

    failed, passed = gate(broken), gate(sound)
    assert not failed.passed and failed.final.heads[0].drop > budget, failed.to_dict()
    assert passed.passed, passed.to_dict()
    session, shape = ort_session(broken), tuple(network.example[STATE_INPUTS[0]].shape)
    on_reference_memory = evaluate(lambda pair: dict(zip([head], session.run(
        [head], {k: v for k, v in with_memory(pair, torch_runner(network.net), shape).items() if k in
                 set(INPUTS) | set(STATE_INPUTS)}))))
    assert on_reference_memory.metrics["heatmap_error"] < budget  # the error the gate must see lives in the memory
