"""Camera-aware depth (model.depth.camera_aware, BEVDepth's DepthNet): the depth head reads what of its camera changes
depth, starts as the plain head, learns, and bakes the rig into an exported graph as it bakes the pooling."""

import math
import warnings

import pytest
import torch

from stack.config import load_pipeline
from stack.errors import StackError
from stack.models import build_model
from stack.models.image_heads import camera_vector
from stack.models.testing import fixed_and_per_batch_outputs, random_batch

warnings.filterwarnings("ignore", message="bev_pool: the extension")
TINY = ["configs/pipeline.yaml", "configs/presets/tiny.yaml"]


def _turned(cam_to_ego: torch.Tensor, angle: float) -> torch.Tensor:
    """cam_to_ego turned about the ego's vertical (what the BEV rotation augmentation does to the cameras)."""
    c, s = math.cos(angle), math.sin(angle)
    turn = torch.eye(4)
    turn[:2, :2] = torch.tensor([[c, -s], [s, c]])
    return turn @ cam_to_ego


@pytest.fixture(scope="module")
def aware():
    pipeline = load_pipeline(TINY, ["model.depth.camera_aware=true"])
    return pipeline, random_batch(pipeline, batch_size=2, seed=0)


def test_the_camera_vector_holds_focal_height_and_tilt_but_not_the_turn_about_the_vertical(aware):
    pipeline, batch = aware
    size = (pipeline.data.rig.image_height, pipeline.data.rig.image_width)
    vector = camera_vector(batch.intrinsics, batch.cam_to_ego, size)
    assert vector.shape == (2 * len(pipeline.data.rig.cameras), 8)
    torch.testing.assert_close(camera_vector(batch.intrinsics, _turned(batch.cam_to_ego, 0.7), size), vector)
    raised = batch.cam_to_ego.clone()
    raised[..., 2, 3] += 0.3
    zoomed = batch.intrinsics.clone()
    zoomed[..., 0, 0] *= 1.2
    assert not torch.allclose(camera_vector(batch.intrinsics, raised, size), vector)
    assert not torch.allclose(camera_vector(zoomed, batch.cam_to_ego, size), vector)


def test_a_new_camera_aware_network_computes_what_the_plain_one_does(aware):
    pipeline, batch = aware
    torch.manual_seed(0)
    plain = build_model(load_pipeline(TINY, ["model.depth.camera_aware=false"])).eval()
    net = build_model(pipeline).eval()
    missing, unexpected = net.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing and all(name.startswith("depth_head.camera_gates.") for name in missing)
    with torch.no_grad():
        ours, theirs = net.forward_batch(batch), plain.forward_batch(batch)
    for name in ("depth_logits", "heatmap", "plan_scores"):
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-5)


def test_the_gates_learn_and_then_another_camera_changes_the_depth(aware):
    pipeline, batch = aware
    torch.manual_seed(1)
    net = build_model(pipeline)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        net.loss(net.forward_batch(batch), batch)["total"].backward()
        optimizer.step()
    gates = dict(net.depth_head.camera_gates.named_parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates.values()), \
        [n for n, p in gates.items() if p.grad is None or p.grad.abs().sum() == 0]
    net.eval()
    raised = batch.cam_to_ego.clone()
    raised[..., 2, 3] += 0.3
    with torch.no_grad():
        _, lift = net.image_encoder(batch.images.flatten(0, 1))
        size = net.image_size
        nominal = net.depth_head(lift, camera_vector(batch.intrinsics, batch.cam_to_ego, size))[0]
        moved = net.depth_head(lift, camera_vector(batch.intrinsics, raised, size))[0]
    assert (nominal - moved).abs().max() > 1e-6, "the depth head reads its camera's height"


def test_export_bakes_the_rig_camera_as_it_bakes_the_pooling(aware):
    pipeline, batch = aware
    torch.manual_seed(2)
    net = build_model(pipeline).eval()
    with torch.no_grad():
        net.depth_head.camera_gates.gates.weight.normal_(std=0.5)  # a camera that matters
    fixed, dynamic = fixed_and_per_batch_outputs(net, batch)
    for name in dynamic:
        torch.testing.assert_close(fixed[name], dynamic[name], atol=1e-4, rtol=1e-4)
    with pytest.raises(StackError, match="camera_aware"):
        net(batch.images, batch.ego_status, batch.command)
