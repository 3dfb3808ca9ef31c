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
from stack.synthetic_batch import random_batch

from helpers import fixed_and_per_batch_outputs

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


def _seen_at(distance: torch.Tensor, focal: torch.Tensor, channels: int) -> torch.Tensor:
    """Lift features (B, C, 5, 5) of an image that shows one road user 1.5 m tall, `distance` metres away under a
    lens of `focal` pixels (B,), at the centre feature: its height in pixels, coded over the channels as radial
    bases of the log (the backbone's part, done here). Apparent size is depth's cue, and it depends on the focal
    length as much as on the distance."""
    size = torch.log(focal * 1.5 / distance) - math.log(20.0)
    centres = torch.linspace(-1.3, 1.4, channels)
    width = float(centres[1] - centres[0])
    features = torch.zeros(distance.shape[0], channels, 5, 5)
    features[:, :, 2, 2] = torch.exp(-(size[:, None] - centres[None]) ** 2 / (2 * width ** 2))
    return features


def _cameras(focal: torch.Tensor, size=(128, 256)) -> torch.Tensor:
    """camera_vector of cameras with focal length `focal` (B,) pixels, centred, 1.5 m up, level."""
    k = torch.zeros(focal.shape[0], 1, 3, 3)
    k[:, 0, 0, 0], k[:, 0, 1, 1], k[:, 0, 2, 2] = focal, focal, 1.0
    k[:, 0, 0, 2], k[:, 0, 1, 2] = size[1] / 2, size[0] / 2
    pose = torch.eye(4).expand(focal.shape[0], 1, 4, 4).clone()
    pose[..., 2, 3] = 1.5
    return camera_vector(k, pose, size)


def test_told_its_focal_length_the_depth_head_resolves_what_the_image_alone_cannot():
    """The mechanism of the camera-aware head (BEVDepth's DepthNet), isolated: both heads learn the depth of a road
    user from its apparent size while the focal length varies as the resize augmentation varies it (x0.9-1.1 of a
    200-pixel lens). A size alone cannot tell a near thing under a short lens from a far one under a long lens: the
    plain head learns the average lens and is wrong by the lens's ratio on any other vehicle (x1.08 here), while the
    camera-aware head, given each image's camera, degrades less than half as much. (In the rendered world the plain
    network reads the scale from other cues, the padded border and the horizon, so there the two degrade alike:
    docs/results/model.md, "Depth: camera-aware against plain".)"""
    from stack.models.image_heads import DepthContextHead, expected_depth
    from stack.ops.bev_pool import depth_bin_centres

    pipeline = load_pipeline(TINY, [])
    centres = depth_bin_centres(pipeline.model.depth, dtype=torch.float32)
    channels, generator = 16, torch.Generator().manual_seed(0)

    def draw(count: int, scale: torch.Tensor | None = None):
        distance = torch.exp(torch.empty(count).uniform_(math.log(5.0), math.log(40.0), generator=generator))
        scale = torch.empty(count).uniform_(0.9, 1.1, generator=generator) if scale is None else scale
        return _seen_at(distance, 200.0 * scale, channels), _cameras(200.0 * scale), distance

    def log_error(head, scale: float) -> float:
        features, cameras, distance = draw(2000, torch.full((2000,), scale))
        with torch.no_grad():
            depth = expected_depth(head.eval()(features, cameras)[0], centres)[:, 2, 2]
        return float((depth.log() - distance.log()).abs().mean())

    errors, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # 5 x 5 maps: threads cost more than they give
    try:
        for aware in (False, True):
            errors[aware] = _trained_errors(DepthContextHead, aware, draw, log_error, centres, channels)
    finally:
        torch.set_num_threads(threads)
    plain, told = errors[False], errors[True]
    assert plain[1.08] - plain[1.0] > 0.025, f"another lens must fool the plain head: {errors}"
    assert told[1.08] - told[1.0] < 0.5 * (plain[1.08] - plain[1.0]), errors
    assert told[1.08] < 0.5 * plain[1.08], errors


def _trained_errors(head_class, aware: bool, draw, log_error, centres, channels) -> dict:
    """{lens scale: mean |log depth error|} of a depth head trained 400 Adam steps on `draw`'s images."""
    from stack.models.image_heads import expected_depth

    torch.manual_seed(0)
    head = head_class(channels, len(centres), camera_aware=aware)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(400):
        features, cameras, distance = draw(256)
        depth = expected_depth(head.train()(features, cameras)[0], centres)[:, 2, 2]
        optimizer.zero_grad()
        (depth.log() - distance.log()).abs().mean().backward()
        optimizer.step()
    return {scale: log_error(head, scale) for scale in (1.0, 1.08)}
