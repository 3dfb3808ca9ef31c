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


def test_speed_profiles_brake_to_a_stop_and_stay_there():
    from stack.kinematics import speed_profile_arcs

    arcs = speed_profile_arcs(torch.tensor([10.0, 0.0]), torch.tensor([-5.0, 0.0, 2.0]), steps=6)
    assert arcs.shape == (2, 3, 6)
    assert arcs[0, 0].tolist() == pytest.approx([4.375, 7.5, 9.375, 10.0, 10.0, 10.0])  # stops after 2 s, 10 m on
    assert arcs[0, 1].tolist() == pytest.approx([5.0, 10.0, 15.0, 20.0, 25.0, 30.0])
    assert arcs[0, 2, -1].item() == pytest.approx(10 * 3 + 0.5 * 2 * 9)
    assert arcs[1, 0].abs().max() == 0 and arcs[1, 2, 1].item() == pytest.approx(1.0)  # standing: only a > 0 moves


def test_along_path_interpolates_by_arc_length_and_runs_on_past_the_end():
    from stack.kinematics import along_path

    corner = torch.tensor([[[2.0, 0.0], [4.0, 0.0], [4.0, 2.0], [4.0, 4.0]]])  # 2 m spacing: 4 ahead, then 4 left
    points = along_path(corner, 2.0, torch.tensor([[1.0, 4.0, 5.0, 8.0, 11.0]]))
    expected = [[1.0, 0.0], [4.0, 0.0], [4.0, 1.0], [4.0, 4.0], [4.0, 7.0]]
    assert points[0].tolist() == [pytest.approx(p) for p in expected]


def test_resample_by_arc_reads_a_trajectory_at_distances_and_continues_a_stopped_one_straight():
    from stack.kinematics import arc_lengths, resample_by_arc

    turn = torch.tensor([[[3.0, 0.0], [6.0, 0.0], [6.0, 3.0], [6.0, 6.0], [6.0, 6.0], [6.0, 6.0]]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    assert arc_lengths(turn, valid)[0].tolist() == pytest.approx([3, 6, 9, 12, 12, 12])
    points, driven = resample_by_arc(turn, valid, torch.tensor([1.5, 7.5, 12.0, 14.0]))
    assert points[0].tolist() == [pytest.approx(p) for p in ([1.5, 0], [6, 1.5], [6, 6], [6, 8])]
    assert driven[0].tolist() == [True, True, True, False]  # the expert stopped at 12 m
    standing = torch.zeros(1, 6, 2)
    forward = torch.tensor([[0.0, 1.0]])  # the body's +x after a 90-degree BEV rotation
    points, driven = resample_by_arc(standing, valid, torch.tensor([2.0]), forward)
    assert points[0, 0].tolist() == pytest.approx([0.0, 2.0]) and not driven.any()
