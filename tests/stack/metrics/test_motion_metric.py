"""What a temporal network reads from the previous key frame: velocity at moving road users' centres, fused vs alone."""

import math

import pytest
import torch

from stack.config import load_pipeline
from stack.metrics.motion import MotionMetric, summary

BEV = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"]).model.bev  # 64 x 64 cells of 1 m


def regression_with(velocities: dict) -> torch.Tensor:
    """(1, 10, 64, 64) box regression, zero but for the velocity {(cell x, cell y): (vx, vy)}."""
    regression = torch.zeros(1, 10, 64, 64)
    for (x, y), v in velocities.items():
        regression[0, 8:10, x, y] = torch.tensor(v)
    return regression


def test_a_network_that_reads_motion_scores_it_and_one_that_guesses_does_not():
    boxes = torch.tensor([[[10.2, 0.5, 0.8, 4.5, 1.9, 1.6, 0.0, 8.0, 0.0],     # a lead car: cell (42, 32)
                           [-5.5, 3.0, 0.8, 4.5, 1.9, 1.6, math.pi, -6.0, 0.0],  # oncoming: cell (26, 35)
                           [20.0, 6.0, 0.9, 0.6, 0.6, 1.8, 0.0, 0.0, 0.5],     # a slow walker: not counted
                           [40.0, 0.0, 0.8, 4.5, 1.9, 1.6, 0.0, 9.0, 0.0],     # off the grid: not counted
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0]]])    # padding
    labels = torch.tensor([[0, 0, 2, 0, -1]])
    metric = MotionMetric(BEV)
    fused = regression_with({(42, 32): (8.0, 0.0), (26, 35): (-6.0, 0.0)})
    alone = regression_with({(42, 32): (2.0, 0.0), (26, 35): (0.0, 0.0)})
    metric.update(fused, alone, boxes, labels)
    out = metric.compute()
    assert out["moving_boxes"] == 2
    assert out["velocity_error"] == 0 and out["velocity_error_alone"] == pytest.approx(6.0)
    assert out["previous_frame_share"] == pytest.approx(1.0)
    assert out["speed_ratio"] == pytest.approx(1.0) and out["speed_ratio_alone"] == pytest.approx(16 / 100)
    lead_along = 10.2 / math.hypot(10.2, 0.5)  # the lead car's 6 m/s shortfall, mostly along its ray
    oncoming_along = 5.5 / math.hypot(5.5, 3.0)
    assert out["along_ray_error_alone"] == pytest.approx((6.0 * lead_along + 6.0 * oncoming_along) / 2, rel=1e-5)
    assert out["across_ray_error_alone"] == pytest.approx(
        (6.0 * 0.5 / math.hypot(10.2, 0.5) + 6.0 * 3.0 / math.hypot(5.5, 3.0)) / 2, rel=1e-5)
    assert out["along_ray_error"] == out["across_ray_error"] == 0
    guessing = MotionMetric(BEV)
    guessing.update(alone, alone, boxes, labels)
    assert guessing.compute()["previous_frame_share"] == 0
    metric.merge(guessing)
    assert metric.compute()["moving_boxes"] == 4
    assert "remove 50% of it" in summary({f"motion/{k}": v for k, v in metric.compute().items()})


def test_no_moving_road_user_gives_nan_figures_not_a_crash():
    metric = MotionMetric(BEV)
    metric.update(regression_with({}), regression_with({}), torch.zeros(1, 0, 9), torch.zeros(1, 0, dtype=torch.long))
    out = metric.compute()
    assert out["moving_boxes"] == 0 and math.isnan(out["velocity_error"]) and math.isnan(out["previous_frame_share"])
    assert math.isnan(out["along_ray_error_alone"]) and "along the ray" in summary({"motion/moving_boxes": 0.0})
