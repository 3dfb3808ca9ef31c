"""Planning metrics on hand-computed cases: both L2 conventions, collisions, minADE/minFDE, baseline."""

import math

import pytest
import torch

from stack.metrics.collision import EGO_RADIUS_M, collides, penetration
from stack.metrics.planning import PlanningMetric, constant_velocity_plan


def straight(speed, steps=6):
    return torch.stack([speed * 0.5 * torch.arange(1, steps + 1), torch.zeros(steps)], -1)[None]


def no_boxes(b=1):
    return torch.zeros(b, 2, 9), torch.full((b, 2), -1)


def test_l2_at_time_and_average_up_to_time():
    future = straight(10.0)  # 5, 10, ..., 30 m along x
    plan = future.clone()
    plan[0, :, 1] = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])  # lateral error grows 0.1 m per step
    metric = PlanningMetric(steps=6)
    past = -straight(10.0, 4).flip(1)
    metric.update(plan, future, torch.ones(1, 6, dtype=torch.bool), *no_boxes(), past)
    r = metric.compute()
    assert r["L2_at_1s"] == pytest.approx(0.2) and r["L2_at_2s"] == pytest.approx(0.4)
    assert r["L2_at_3s"] == pytest.approx(0.6)
    assert r["L2_avg_1s"] == pytest.approx(0.15)  # mean(0.1, 0.2): ST-P3 / VAD
    assert r["L2_avg_2s"] == pytest.approx(0.25) and r["L2_avg_3s"] == pytest.approx(0.35)
    assert r["baseline_cv/L2_at_3s"] == pytest.approx(0.0, abs=1e-9)  # constant speed: the baseline is exact
    assert r["collision_at_3s"] == 0 and r["gt/collision_avg_3s"] == 0


def test_invalid_waypoints_are_excluded():
    future, plan = straight(4.0), straight(4.0) + torch.tensor([0.0, 1.0])
    plan[0, 5] = torch.tensor([100.0, 100.0])
    valid = torch.tensor([[True, True, True, True, True, False]])
    metric = PlanningMetric(steps=6)
    metric.update(plan, future, valid, *no_boxes(), -straight(4.0, 4).flip(1), modes=plan[:, None])
    r = metric.compute()
    assert r["L2_at_2s"] == pytest.approx(1.0) and math.isnan(r["L2_at_3s"]) and math.isnan(r["L2_avg_3s"])
    assert r["minADE"] == pytest.approx(1.0) and r["minFDE"] == pytest.approx(1.0)  # last valid = step 5


def test_min_ade_fde_take_the_best_mode():
    future = straight(6.0)
    modes = torch.stack([future[0] + torch.tensor([0.0, 3.0]), future[0] + torch.tensor([0.0, -0.5]),
                         future[0] * 0.0], 0)[None]
    metric = PlanningMetric(steps=6)
    metric.update(modes[:, 0], future, torch.ones(1, 6, dtype=torch.bool), *no_boxes(), torch.zeros(1, 4, 2), modes)
    r = metric.compute()
    assert r["minADE"] == pytest.approx(0.5) and r["minFDE"] == pytest.approx(0.5)
    assert r["L2_at_3s"] == pytest.approx(3.0)  # the chosen plan is mode 0


def test_collision_rate_with_moving_boxes():
    plan = straight(10.0)  # x = 5, 10, ..., 30 at t = 0.5 ... 3 s
    car = torch.tensor([[[21.0, 8.0, 0.8, 4.0, 2.0, 1.5, 0.0, 0.0, -4.0]]])  # drives across: y = 8 - 4 t
    labels = torch.tensor([[0]])
    hit = collides(plan, car, labels >= 0)[0]
    # at t = 2 s the car is at (21, 0) and the ego at x = 20: inside 2 + 0.925 m along x, 1 + 0.925 m across
    assert hit.tolist() == [False, False, False, True, False, False]
    metric = PlanningMetric(steps=6)
    metric.update(plan, plan, torch.ones(1, 6, dtype=torch.bool), car, labels, torch.zeros(1, 4, 2))
    r = metric.compute()
    assert r["collision_at_2s"] == 1.0 and r["collision_at_1s"] == 0.0 and r["collision_at_3s"] == 0.0
    assert r["collision_avg_2s"] == pytest.approx(0.25) and r["collision_avg_3s"] == pytest.approx(1 / 6)
    assert r["baseline_cv/collision_at_2s"] == 0.0  # standing still: the car passes ahead of the ego
    depth = penetration(plan, car, labels >= 0)[0, 3, 0]
    assert float(depth) == pytest.approx(min(2.0 + EGO_RADIUS_M - 1.0, 1.0 + EGO_RADIUS_M - 0.0))


def test_constant_velocity_baseline_extrapolates_the_last_step():
    past = torch.tensor([[[-4.0, -1.0], [-3.0, -0.75], [-2.0, -0.5], [-1.0, -0.25]]])
    plan = constant_velocity_plan(past, steps=3)
    torch.testing.assert_close(plan, torch.tensor([[[1.0, 0.25], [2.0, 0.5], [3.0, 0.75]]]))


def test_horizons_beyond_the_plan_are_not_reported():
    metric = PlanningMetric(steps=2)
    metric.update(straight(2.0, 2), straight(2.0, 2), torch.ones(1, 2, dtype=torch.bool), *no_boxes(),
                  torch.zeros(1, 4, 2))
    assert "L2_at_1s" in metric.compute() and "L2_at_2s" not in metric.compute()


def test_ego_rollout_baseline_is_reported_when_the_ego_status_is_given():
    future = straight(10.0)
    metric = PlanningMetric(steps=6)
    past = -straight(8.0, 4).flip(1)  # the past says 8 m/s; the ego status (10 m/s) is right
    metric.update(future, future, torch.ones(1, 6, dtype=torch.bool), *no_boxes(), past,
                  ego_status=torch.tensor([[10.0, 0.0, 0.0]]))
    r = metric.compute()
    assert r["baseline_ego_rollout/L2_at_3s"] == pytest.approx(0.0, abs=1e-4)
    assert r["baseline_cv/L2_at_3s"] == pytest.approx(6.0)


def test_departure_reproduced_is_the_share_of_the_experts_departure_from_the_rollout():
    """Frame 0: the expert brakes (ends 6 m short of the 10 m/s rollout); frame 1: it follows the rollout (no
    departure, left out). A plan that copies the rollout reproduces 0 of the departure, the expert's plan 1,
    one that brakes half as much 0.5."""
    from stack.kinematics import kinematic_rollout

    status = torch.tensor([[10.0, 0.0, 0.0], [10.0, 0.0, 0.0]])
    rollout = kinematic_rollout(status, 6)
    braking = rollout.clone()
    braking[0] = rollout[0] * torch.linspace(0.9, 0.8, 6)[:, None]
    valid = torch.ones(2, 6, dtype=torch.bool)
    shares = {}
    for name, plan in (("rollout", rollout), ("expert", braking), ("half", (rollout + braking) / 2)):
        metric = PlanningMetric(steps=6)
        past = -straight(10.0, 4).flip(1).expand(2, -1, -1)
        metric.update(plan, braking, valid, *no_boxes(2), past, ego_status=status)
        result = metric.compute()
        shares[name] = result["departure_reproduced"]
        assert result["departure_share"] == pytest.approx(0.5)
    assert shares == pytest.approx({"rollout": 0.0, "expert": 1.0, "half": 0.5})
