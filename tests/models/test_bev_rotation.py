"""BEV-rotation augmentation and planning share one frame: the planner plans in the body frame, turns its plan
by the batch's `bev_rotation`, and is scored against targets and boxes rotated by the same angle."""

import math

import pytest
import torch

from stack.batch import Batch
from stack.config import load_pipeline
from stack.data.augment import rotate_bev
from stack.kinematics import kinematic_rollout
from stack.models import build_model
from stack.models.bev_heads import rotate_trajectories
from stack.models.losses import planning_loss
from stack.synthetic_batch import random_batch

TINY = ["configs/pipeline.yaml", "configs/presets/tiny.yaml"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    pipeline = load_pipeline(TINY)
    return pipeline, build_model(pipeline).eval()


def _rotated(batch: Batch, angle: float) -> Batch:
    """`batch` with every row rotated by `angle` through the augmentation's own `rotate_bev`."""
    rows = [{name: tensor[i].clone() for name, tensor in batch.tensors().items()} for i in range(batch.images.shape[0])]
    for row in rows:
        rotate_bev(row, angle)
    return Batch(**{name: torch.stack([row[name] for row in rows]) for name in rows[0]})


def _head_that_plans(head, batch: Batch) -> None:
    """Set the head's waypoint layer so that every mode plans exactly batch row 0's future in the body frame."""
    prior = kinematic_rollout(batch.ego_status[:1], head.steps)[0]
    residual = batch.future_trajectory[0] - prior
    steps = torch.diff(residual, dim=0, prepend=torch.zeros(1, 2))
    with torch.no_grad():
        head.waypoints.weight.zero_()
        head.waypoints.bias.copy_(steps.flatten())


def _plan_loss(head, bev, batch: Batch, rotation) -> dict:
    trajectories, scores = head(bev, batch.ego_status, batch.command, rotation)
    return planning_loss({"plan_trajectories": trajectories, "plan_scores": scores}, batch)


def test_rotation_none_and_zero_give_the_same_outputs(tiny):
    pipeline, model = tiny
    batch = random_batch(pipeline, batch_size=2, seed=4)
    geometry = model.geometry(batch.intrinsics, batch.cam_to_ego)
    with torch.no_grad():
        plain = model(batch.images, batch.ego_status, batch.command, geometry)
        zero = model(batch.images, batch.ego_status, batch.command, geometry, torch.zeros(2))
    for name in plain:
        assert torch.equal(plain[name], zero[name]), name


def test_a_rotation_turns_the_plan_and_reaches_the_ego_query(tiny):
    pipeline, model = tiny
    head = model.planning_head
    batch = random_batch(pipeline, batch_size=2, seed=5)
    bev = torch.randn(2, pipeline.model.bev_channels, *model.grid)
    original = {name: p.clone() for name, p in head.state_dict().items()}
    try:
        with torch.no_grad():  # a trained head: both layers carry weights
            head.rotation.weight.normal_()
            head.waypoints.weight.normal_(std=0.05)
            base, scores = head(bev, batch.ego_status, batch.command, torch.zeros(2))
            turned, turned_scores = head(bev, batch.ego_status, batch.command, torch.full((2,), 0.4))
    finally:
        head.load_state_dict(original)
    # the ego query sees the angle (scores change), and the plan is not the zero-angle plan merely turned
    assert not torch.allclose(scores, turned_scores)
    assert not torch.allclose(rotate_trajectories(base, torch.full((2,), 0.4)), turned, atol=1e-3)
    # a pure turn: distances from the ego are kept
    prior = rotate_trajectories(kinematic_rollout(batch.ego_status, head.steps), torch.full((2,), 0.4))
    torch.testing.assert_close(prior.norm(dim=-1), kinematic_rollout(batch.ego_status, head.steps).norm(dim=-1))


def test_planning_loss_of_a_perfect_body_frame_plan_does_not_change_under_rotation(tiny):
    pipeline, model = tiny
    head = model.planning_head
    batch = random_batch(pipeline, batch_size=1, seed=6)
    batch.ego_status[0] = torch.tensor([8.0, 0.0, 0.1])
    batch.boxes[0, 0] = torch.tensor([0, 0, 0.8, 4.5, 1.9, 1.6, 0.3, 0, 0])
    batch.boxes[0, 0, :2] = batch.future_trajectory[0, 3] + torch.tensor([0.5, 0.3])  # a parked car on the 2 s plan
    batch.box_labels[0, 0] = 0
    bev = torch.randn(1, pipeline.model.bev_channels, *model.grid)
    original = {name: p.clone() for name, p in head.state_dict().items()}
    try:
        _head_that_plans(head, batch)
        with torch.no_grad():
            reference = _plan_loss(head, bev, batch, batch.bev_rotation)
            for degrees in (-30.0, 12.0, 90.0):
                rotated = _rotated(batch, math.radians(degrees))
                assert rotated.bev_rotation.item() == pytest.approx(math.radians(degrees))
                terms = _plan_loss(head, bev, rotated, rotated.bev_rotation)
                assert reference["plan_collision"] > 0.1  # the test means something only if the plan hits the box
                assert abs(terms["plan_l2"] - reference["plan_l2"]) < 1e-4, degrees
                assert abs(terms["plan_collision"] - reference["plan_collision"]) < 1e-4, degrees
                # the old behaviour, an unrotated plan scored in the rotated frame, is visibly wrong
                unturned = _plan_loss(head, bev, rotated, None)
                assert unturned["plan_l2"] > reference["plan_l2"] + 0.5, degrees
    finally:
        head.load_state_dict(original)


def test_a_batch_built_by_hand_without_the_angle_is_unrotated(tiny):
    pipeline, _ = tiny
    batch = random_batch(pipeline, batch_size=3, seed=7)
    by_hand = Batch(**{name: tensor for name, tensor in batch.tensors().items() if name != "bev_rotation"})
    assert by_hand.bev_rotation.dtype == torch.float32 and by_hand.bev_rotation.tolist() == [0.0, 0.0, 0.0]
    assert by_hand.mismatches(pipeline) == [] and by_hand.to("cpu").bev_rotation.shape == (3,)
    by_hand.bev_rotation = torch.zeros(3, dtype=torch.float64)  # a loader that forgot the dtype is caught
    assert by_hand.mismatches(pipeline) == ["bev_rotation: expected float32 (3,), found float64 (3,)"]
