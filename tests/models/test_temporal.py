"""Temporal BEV fusion (stack.models.temporal, model.temporal_frames=1): the previous BEV lands where the ego motion
says, a frame fused with itself at zero motion is the sequence-start rule, and the one-frame network is unchanged."""

import dataclasses
import math

import pytest
import torch

from stack.config import load_pipeline
from stack.models import build_model
from stack.models.outputs import output_names
from stack.models.temporal import cell_centres, warp_previous_bev
from stack.synthetic_batch import random_batch

TINY = ["configs/pipeline.yaml", "configs/presets/tiny.yaml"]
RANGES = ((-32.0, 32.0), (-32.0, 32.0))


def _turn(point, angle):
    c, s = math.cos(angle), math.sin(angle)
    return (c * point[0] - s * point[1], s * point[0] + c * point[1])


def _cell(point):
    return int((point[0] + 32.0) // 1.0), int((point[1] + 32.0) // 1.0)


@pytest.mark.parametrize("theta", [0.0, 0.4, -2.0])
def test_a_mark_in_the_previous_bev_lands_where_the_ego_motion_puts_it(theta):
    """The ego drove 6 m and turned 0.3 rad since the previous frame, which saw a mark 12 m ahead and 5 m left: in
    today's frame the mark is at R(yaw) q + t; under BEV rotation θ both grids are turned, and so is the answer."""
    pose = (-6.0, -1.0, -0.3)  # the previous ego in today's body frame
    seen_then = (12.5, 5.5)
    now = _turn(seen_then, pose[2])
    now = (now[0] + pose[0], now[1] + pose[1])
    previous = torch.zeros(1, 1, 64, 64)
    previous[0, 0, _cell(_turn(seen_then, theta))[0], _cell(_turn(seen_then, theta))[1]] = 1.0
    warped = warp_previous_bev(previous, torch.tensor([pose]), torch.tensor([theta]), *RANGES)[0, 0]
    peak = divmod(int(warped.argmax()), 64)
    expected = _cell(_turn(now, theta))
    assert abs(peak[0] - expected[0]) <= 1 and abs(peak[1] - expected[1]) <= 1, (peak, expected)
    assert float(warped.max()) > 0.2


def test_zero_motion_is_the_identity():
    bev = torch.randn(2, 3, 64, 64)
    warped = warp_previous_bev(bev, torch.zeros(2, 3), torch.tensor([0.0, 0.7]), *RANGES)
    assert torch.equal(warped[0], bev[0]) and torch.allclose(warped[1], bev[1], atol=1e-4)  # float32 turns
    assert cell_centres((64, 64), *RANGES)[0, 0].tolist() == [-31.5, -31.5]


def test_the_temporal_network_fuses_the_previous_frame_and_returns_its_memory():
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY, ["model.temporal_frames=1"])
    net = build_model(pipeline).eval()
    batch = random_batch(pipeline, batch_size=2, seed=0)
    assert batch.mismatches(pipeline) == []
    geometry = net.geometry(batch.intrinsics, batch.cam_to_ego)
    with torch.no_grad():
        alone = net(batch.images, batch.ego_status, batch.command, geometry)
        itself = net(batch.images, batch.ego_status, batch.command, geometry, None, alone["bev_memory"],
                     torch.zeros(2, 3))
        fused = net.forward_batch(batch)
    assert set(alone) == set(output_names(pipeline.model)) | {"bev_memory"}
    assert torch.allclose(alone["plan_scores"], itself["plan_scores"], atol=1e-5), "a sequence start fuses the frame with itself"
    assert not torch.allclose(alone["heatmap"], fused["heatmap"]), "another previous frame changes what it sees"
    single = load_pipeline(TINY, [])
    assert set(build_model(single).eval()(batch.images, batch.ego_status, batch.command,
                                          geometry)) == set(output_names(single.model)), "k = 0: today's outputs"
    widths = {name: tuple(p.shape) for name, p in build_model(single).state_dict().items()}
    temporal = {name: tuple(p.shape) for name, p in net.state_dict().items()}
    changed = [n for n in temporal if widths.get(n) != temporal[n]]
    assert widths.keys() <= temporal.keys() and changed, "k = 1 only widens the BEV encoder's input"
    assert all(n.startswith("bev_encoder.stem.") for n in changed), changed


def test_the_pre_encoder_encodes_each_frame_and_its_output_is_the_memory_the_next_frame_fuses():
    """model.temporal_pre_blocks (BEVDet4D's pre-process net): the memory handed to the next key frame is the
    pre-encoded BEV, the same whether the frame ran whole or only up to the memory (as the previous frame does in
    training), and as wide as the view transform's BEV, so the stateful graph's memory input keeps its shape."""
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY, ["model.temporal_frames=1", "model.temporal_pre_blocks=2"])
    net = build_model(pipeline).eval()
    batch = random_batch(pipeline, batch_size=2, seed=0)
    geometry = net.geometry(batch.intrinsics, batch.cam_to_ego)
    with torch.no_grad():
        memory = net(batch.images, batch.ego_status, batch.command, geometry)["bev_memory"]
        assert torch.allclose(memory, net.memory(batch.images, geometry), atol=1e-5)
        encoder, net.bev_pre_encoder = net.bev_pre_encoder, torch.nn.Sequential()
        splat = net.memory(batch.images, geometry)
        net.bev_pre_encoder = encoder
    assert memory.shape == splat.shape == (2, pipeline.model.neck_channels, 64, 64)
    assert not torch.allclose(memory, splat, atol=1e-3), "the memory is the encoder's output, not the splat"
    assert len(encoder) == 2 and sum(p.numel() for p in encoder.parameters()) > 0


def test_a_pre_encoder_without_temporal_fusion_is_refused():
    from stack.config import ConfigError

    with pytest.raises(ConfigError, match="temporal_pre_blocks.*temporal_frames: 1"):
        load_pipeline(TINY, ["model.temporal_pre_blocks=2"])


def test_k_frames_carried_as_one_memory_give_what_the_training_window_gives():
    """model.temporal_frames=2: stepping the network frame by frame, oldest first, each fed the memory the one
    before returned (the deployed graph's recurrence), scores the newest frame exactly as `forward_batch` does from
    the window of k previous frames the loader gives (`BevNet.previous_memory`), under BEV rotation too. A sequence
    start's memory holds its own BEV in every slot, and the memory is k BEVs wide."""
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY, ["model.temporal_frames=2"])
    net = build_model(pipeline).eval()
    batch = random_batch(pipeline, batch_size=2, seed=0)
    batch.bev_rotation = torch.tensor([0.3, -0.2])
    assert batch.mismatches(pipeline) == []
    geometry = net.geometry(batch.intrinsics, batch.cam_to_ego)
    status, command, theta = batch.ego_status, batch.command, batch.bev_rotation
    with torch.no_grad():
        oldest = net(batch.earlier_images, status, command, geometry, theta)
        previous = net(batch.previous_images, status, command, geometry, theta, oldest["bev_memory"],
                       batch.earlier_poses[:, 0])
        stepped = net(batch.images, status, command, geometry, theta, previous["bev_memory"], batch.previous_pose)
        window = net.forward_batch(batch)
    channels = pipeline.model.neck_channels
    assert stepped["bev_memory"].shape == (2, 2 * channels, 64, 64)
    assert torch.equal(oldest["bev_memory"][:, :channels], oldest["bev_memory"][:, channels:]), "a start repeats"
    for name in output_names(pipeline.model):
        assert torch.allclose(stepped[name], window[name], atol=1e-5), name
    with torch.no_grad():  # the oldest frame matters: another one there changes the newest frame's detections
        other = dataclasses.replace(batch, earlier_images=batch.previous_images)
        assert not torch.allclose(net.forward_batch(other)["heatmap"], window["heatmap"], atol=1e-5)
    one = {name: tuple(p.shape) for name, p in build_model(load_pipeline(TINY, ["model.temporal_frames=1"]))
           .state_dict().items()}
    two = {name: tuple(p.shape) for name, p in net.state_dict().items()}
    assert one.keys() == two.keys() and all(n.startswith("bev_encoder.stem.") for n in two if one[n] != two[n])
