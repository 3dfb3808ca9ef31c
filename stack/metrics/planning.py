"""Open-loop planning metrics: L2 in both published conventions, collisions, minADE/minFDE.

The literature reports "L2 at 1/2/3 s" in two incompatible ways (UniAD issue #166,
github.com/OpenDriveLab/UniAD/issues/166):

- `L2_at_{t}s` — the error of the waypoint AT time t (UniAD, arXiv:2212.10156);
- `L2_avg_{t}s` — the mean error over all waypoints UP TO t (ST-P3, arXiv:2207.07601;
  VAD, arXiv:2303.12077), which is smaller for the same plan.

Collision rate follows the same two conventions (`collision_at_*`, `collision_avg_*`):
a waypoint collides when it lies inside a ground-truth box moved at the box's own
constant velocity to that waypoint's time, inflated by the ego's half width
(`stack.metrics.collision`). A waypoint counts only where `future_valid` is true; an
average up to t uses samples whose waypoints up to t are all valid.

minADE / minFDE take the best of the K candidate trajectories (mean L2 over valid
waypoints / L2 at the last valid waypoint). Baseline: the constant-velocity planner,
which extrapolates the last past displacement (`past_trajectory[-1]` → origin);
given the ego status, the ego rollout at constant acceleration and yaw rate
(`stack.kinematics.kinematic_rollout`, the planning head's prior) is reported beside
it as `baseline_ego_rollout/*`, the stronger reference a learned planner starts from;
the ground-truth trajectory's own collision rate is reported as the floor that box
extrapolation allows.
"""

from __future__ import annotations

import torch

from stack.kinematics import WAYPOINT_STEP_S, kinematic_rollout
from stack.metrics.collision import collides

HORIZONS_S = (1.0, 2.0, 3.0)


def constant_velocity_plan(past_trajectory: torch.Tensor, steps: int, step_s: float = WAYPOINT_STEP_S) -> torch.Tensor:
    """(B, T, 2): keep the velocity of the last past step (past (B, P, 2), oldest first, ending before t=0)."""
    velocity = -past_trajectory[:, -1] / step_s  # from the last past position to the origin, over one step
    times = step_s * torch.arange(1, steps + 1, dtype=past_trajectory.dtype, device=past_trajectory.device)
    return velocity[:, None, :] * times[None, :, None]


DEPARTURE_M = 1.0
"""Frames whose expert waypoint at the horizon lies this far from the ego-status rollout's are those where the
scene, not the ego's own motion, decides the plan (`PlanningMetric._add_departure`)."""
DEPARTURE_BAR = 0.5
"""A planner must reproduce at least this share of the expert's departures from the rollout (`stack eval`)."""


class PlanningMetric:
    """Accumulates per-waypoint errors and collisions; `compute` reports both L2 conventions."""

    def __init__(self, steps: int, step_s: float = WAYPOINT_STEP_S, horizons_s=HORIZONS_S):
        self.steps, self.step_s = steps, step_s
        self.horizons = [(h, round(h / step_s)) for h in horizons_s if round(h / step_s) <= steps]
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def _add(self, key: str, total: torch.Tensor, count: torch.Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(total)
        self.counts[key] = self.counts.get(key, 0.0) + float(count)

    def _add_conventions(self, prefix: str, per_step: torch.Tensor, valid: torch.Tensor) -> None:
        """per_step (B, T) values; adds `{prefix}_at_{h}s` and `{prefix}_avg_{h}s` for each horizon."""
        for seconds, n in self.horizons:
            at = valid[:, n - 1]
            self._add(f"{prefix}_at_{seconds:g}s", (per_step[:, n - 1] * at).sum(), at.sum())
            whole = valid[:, :n].all(dim=1)
            self._add(f"{prefix}_avg_{seconds:g}s", (per_step[:, :n].mean(dim=1) * whole).sum(), whole.sum())

    @torch.no_grad()
    def update(self, plan, future, future_valid, boxes, box_labels, past_trajectory, modes=None,
               ego_status=None) -> None:
        """plan (B, T, 2) chosen trajectory; GT future (B, T, 2), future_valid (B, T); boxes (B, M, 9),
        box_labels (B, M); past_trajectory (B, P, 2); optional modes (B, K, T, 2) for minADE/minFDE
        and ego_status (B, 3) for the ego-rollout baseline."""
        plan, future = plan.detach().double().cpu(), future.double().cpu()
        valid, box_valid = future_valid.bool().cpu(), box_labels.cpu() >= 0
        boxes = boxes.double().cpu()
        baseline = constant_velocity_plan(past_trajectory.double().cpu(), self.steps, self.step_s)
        for prefix, trajectory in (("L2", plan), ("baseline_cv/L2", baseline)):
            self._add_conventions(prefix, (trajectory - future).norm(dim=-1), valid)
        if ego_status is not None:
            rollout = kinematic_rollout(ego_status.cpu(), self.steps, self.step_s).double()
            self._add_conventions("baseline_ego_rollout/L2", (rollout - future).norm(dim=-1), valid)
            self._add_departure(plan, rollout, future, valid)
        for prefix, trajectory in (("collision", plan), ("baseline_cv/collision", baseline),
                                   ("gt/collision", future)):
            self._add_conventions(prefix, collides(trajectory, boxes, box_valid).double(), valid)
        if modes is not None:
            self._add_modes(modes.detach().double().cpu(), future, valid)

    def _add_departure(self, plan: torch.Tensor, rollout: torch.Tensor, future: torch.Tensor,
                       valid: torch.Tensor) -> None:
        """`departure_reproduced`: on frames whose expert waypoint at the horizon lies more than DEPARTURE_M from
        the ego-status rollout's, the share of that departure the plan reproduces (its own departure projected on
        the expert's, over the expert's length; 0 = the rollout, 1 = the expert, mean over those frames), and
        `departure_share`, the share of frames that are such frames. The mechanism behind a closed-loop gain: a planner that only
        copies its ego-status prior scores 0 here (Li et al., CVPR 2024, "Is ego status all you need...")."""
        last = valid[:, -1]
        expert = future[:, -1] - rollout[:, -1]
        length = expert.norm(dim=-1)
        chosen = last & (length > DEPARTURE_M)
        share = ((plan[:, -1] - rollout[:, -1]) * expert).sum(-1) / length.clamp(min=1e-9) ** 2
        self._add("departure_reproduced", (share * chosen).sum(), chosen.sum())
        self._add("departure_share", chosen.sum(), last.sum())

    def _add_modes(self, modes: torch.Tensor, future: torch.Tensor, valid: torch.Tensor) -> None:
        errors = (modes - future[:, None]).norm(dim=-1)  # (B, K, T)
        counts = valid.sum(dim=1)
        has = counts > 0
        ade = ((errors * valid[:, None]).sum(-1) / counts.clamp(min=1)[:, None]).amin(dim=1)
        last = (valid.cumsum(dim=1) == counts[:, None]) & valid  # the last valid waypoint
        fde = (errors * last[:, None]).sum(-1).amin(dim=1)
        self._add("minADE", (ade * has).sum(), has.sum())
        self._add("minFDE", (fde * has).sum(), has.sum())

    def merge(self, other: "PlanningMetric") -> None:
        """Add another accumulator's sums and counts (e.g. from another rank)."""
        for key in other.sums:
            self.sums[key] = self.sums.get(key, 0.0) + other.sums[key]
            self.counts[key] = self.counts.get(key, 0.0) + other.counts[key]

    def compute(self) -> dict[str, float]:
        return {key: self.sums[key] / self.counts[key] if self.counts[key] else float("nan") for key in self.sums}
