"""The plan guard: the planner's best candidate that runs into none of the network's own detections."""

import math

import numpy as np
import pytest
import torch

from stack.config import load_pipeline
from stack.kinematics import along_path, speed_profile_arcs
from stack.models.plan_guard import colliding_candidates, guarded_choice

ACCELERATIONS = [-7.0, -3.0, -1.0, 0.0, 1.5]
CAR = [4.5, 1.9, 1.6]


def candidates(speed: float, bend: float = 0.0) -> torch.Tensor:
    """(K, 6, 2): the constant-acceleration candidates along one path from `speed` m/s (bending by `bend` rad/point)."""
    heading = torch.full((16,), bend).cumsum(0)
    path = (torch.stack([torch.cos(heading), torch.sin(heading)], dim=-1) * 2.5).cumsum(0)[None]
    arcs = speed_profile_arcs(torch.tensor([speed]), torch.tensor(ACCELERATIONS), 6)
    return along_path(path, 2.5, arcs)[0]


def box(x: float, y: float = 0.0, vx: float = 0.0, vy: float = 0.0, yaw: float = 0.0) -> torch.Tensor:
    return torch.tensor([[x, y, 0.8, *CAR, yaw, vx, vy]])


PREFERS_HOLDING_SPEED = torch.tensor([-5.0, -3.0, -1.0, 0.0, -0.5])


def test_a_stopped_car_ahead_rules_out_the_candidates_that_could_not_stop_before_it():
    """8 m/s, a car standing 30 m ahead (rear bumper 27.75 m on): holding speed ends the horizon at 24 m with the
    bumper 0.15 m short, but needs 9 m more to stop at 3.5 m/s^2; -1 m/s^2 ends at 5 m/s and stops 1 m short."""
    trajectories = candidates(8.0)
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, torch.zeros(0, 9), 3.5) == 3  # nothing detected
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(30.0), 3.5) == 2
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(30.0, vx=8.0), 3.5) == 3  # a lead car: drive on
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(30.0, y=4.0), 3.5) == 3  # beside the path


def test_it_reads_the_path_the_candidates_share_and_what_crosses_it():
    """On a bending path the car standing on the straight line is not in the way; a pedestrian walking into the
    path is, where the candidate will be when they get there."""
    bent = candidates(8.0, bend=0.06)
    assert guarded_choice(bent, PREFERS_HOLDING_SPEED, box(30.0), 3.5) == 3
    straight = candidates(8.0)
    walker = torch.tensor([[20.0, -6.0, 0.9, 0.6, 0.6, 1.8, math.pi / 2, 0.0, 2.0]])  # on the path in 3 s
    hits = colliding_candidates(straight, walker, 3.5)
    assert hits[3] and not hits[0]  # holding speed meets them at 20 m; the hardest braking stops at 4.6 m
    walker[0, 8] = 0.0  # standing on the kerb 6 m to the side
    assert not colliding_candidates(straight, walker, 3.5).any()


def test_what_comes_from_behind_is_not_braked_for_and_with_no_way_out_it_brakes_hardest():
    trajectories = candidates(8.0)
    behind = box(-6.0, vx=14.0)  # a faster car closing from behind
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, behind, 3.5) == 3
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(6.0), 3.5) == 0  # every candidate hits it


def _outputs(pipeline, peak_logit: float):
    """Network outputs with one car detected 30 m ahead (score sigmoid(peak_logit)) and candidates at 8 m/s."""
    bev = pipeline.model.bev
    cells = [round((r[1] - r[0]) / bev.cell_size) for r in (bev.x_range, bev.y_range)]
    heatmap = np.full((1, len(pipeline.model.detection_classes), *cells), -10.0, np.float32)
    regression = np.zeros((1, 10, *cells), np.float32)
    cx, cy = int((30.0 - bev.x_range[0]) / bev.cell_size), int((0.0 - bev.y_range[0]) / bev.cell_size)
    heatmap[0, 0, cx, cy] = peak_logit
    regression[0, 3:6, cx, cy] = np.log(CAR)
    regression[0, 7, cx, cy] = 1.0  # cos(yaw)
    return {"plan_trajectories": candidates(8.0)[None].numpy(), "plan_scores": PREFERS_HOLDING_SPEED[None].numpy(),
            "heatmap": heatmap, "box_regression": regression}


@pytest.mark.parametrize("guard, peak, expected", [(0.0, 2.0, 3), (0.3, 2.0, 2), (0.3, -2.0, 3)],
                         ids=["no-guard", "detected", "below-the-guard-score"])
def test_a_network_policy_drives_the_guarded_plan_only_when_asked_and_only_for_what_it_detects(guard, peak, expected):
    from stack.deploy.network_policies import guarded_plan

    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"],
                             [f"model.plan_guard_score={guard}"])
    outputs = _outputs(pipeline, peak)
    np.testing.assert_allclose(guarded_plan(outputs, pipeline), outputs["plan_trajectories"][0, expected])


def test_bad_guard_settings_are_refused_with_the_key_named():
    from stack.errors import StackError

    for bad, key in (("model.plan_guard_score=1.5", "plan_guard_score"),
                     ("model.plan_guard_deceleration=0", "plan_guard_deceleration")):
        with pytest.raises(StackError, match=key):
            load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"], [bad])


def test_a_checkpoint_drives_with_any_guard_setting_but_not_with_another_network():
    from stack.checkpoint.model_file import model_differences

    files = ["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"]
    trained = load_pipeline(files, ["model.temporal_frames=1"])
    guarded = load_pipeline(files, ["model.temporal_frames=1", "model.plan_guard_score=0.3",
                                    "model.plan_guard_deceleration=5"])
    assert model_differences(trained, guarded) == []
    other = load_pipeline(files, ["model.temporal_frames=1", "model.planning_velocity=true"])
    assert [key for key, _, _ in model_differences(trained, other)] == ["model.planning_velocity"]
