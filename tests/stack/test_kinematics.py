"""The ego rollout the planning head starts from and the planning metric reports as a baseline."""

import math

import pytest
import torch

from stack.kinematics import kinematic_rollout


def test_constant_speed_goes_straight_at_that_speed():
    path = kinematic_rollout(torch.tensor([[10.0, 0.0, 0.0]]), steps=6)
    assert path.shape == (1, 6, 2)
    assert path[0, :, 0].tolist() == pytest.approx([5.0, 10.0, 15.0, 20.0, 25.0, 30.0], rel=1e-5)
    assert path[0, :, 1].abs().max() < 1e-6


def test_braking_stops_and_never_reverses():
    path = kinematic_rollout(torch.tensor([[4.0, -4.0, 0.0]]), steps=6)  # stops after 1 s, 2 m on
    assert path[0, -1, 0].item() == pytest.approx(2.0, abs=0.02)
    assert (path[0, 1:, 0] - path[0, :-1, 0]).min() >= -1e-6


def test_constant_acceleration_covers_v_t_plus_half_a_t_squared():
    path = kinematic_rollout(torch.tensor([[5.0, 1.0, 0.0]]), steps=6)
    assert path[0, -1, 0].item() == pytest.approx(5.0 * 3 + 0.5 * 1.0 * 9, rel=1e-4)


def test_constant_yaw_rate_follows_a_circle_of_radius_speed_over_rate():
    speed, rate = 8.0, 0.4
    path = kinematic_rollout(torch.tensor([[speed, 0.0, rate]]), steps=6).double()
    radius = speed / rate  # the centre is at (0, radius) for a left turn
    distance = (path[0] - torch.tensor([0.0, radius], dtype=torch.float64)).norm(dim=-1)
    assert distance.tolist() == pytest.approx([radius] * 6, rel=2e-3)
    assert path[0, -1, 1].item() > 0  # positive yaw rate turns left (y is left)
    assert math.atan2(path[0, -1, 0].item(), radius - path[0, -1, 1].item()) == pytest.approx(rate * 3.0, rel=2e-3)
