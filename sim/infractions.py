"""Infractions that end a drive, recorded as events (time, place, actor) while the episode runs.

The simulator must not flatter a policy: a car that crashed does not drive on and keep earning route
completion. Following the CARLA leaderboard (leaderboard.carla.org/#driving-score and its
`statistics_manager` / scenario_runner criteria), an episode ends early, and is scored on the part of the
route it completed, when:

- **collision**: the ego is at fault in a collision with a road user or a parked car (nuPlan's fault rule,
  `stack.metrics.driving.collision_kind`, the same one the scores use). In CARLA physics stops a car that
  crashes and the route is then scored on its completed part; nuPlan and NAVSIM zero the no-at-fault-
  collision multiplier. The collision's own penalty is applied by the scores (CARLA_PENALTIES, NAVSIM NC).
- **blocked**: for `drive.blocked_seconds` on end, every simulation step, the ego stood (speed under
  BLOCKED_SPEED) while the privileged expert, placed where the ego is, would move on (CARLA's
  AgentBlockedTest: under 0.5 m/s for 180 s; our episodes last seconds). The expert is asked at every step
  of the window, not once at its end: a car that waits, rightly, behind a stopped lead or for a pedestrian
  and is slow to pull away once the way clears is not blocked; only standing where the expert would
  have driven on for the whole window is.
- **route deviation**: the ego's centre is more than `drive.route_deviation_m` from its route's centreline
  (CARLA's InRouteTest ends a route 30 m off it on its multi-lane maps; our roads are 12 m wide).

Off-road driving is not an ending: route completion drops the share of the route driven off-road
(`stack.metrics.driving.route_completion`). The minimum-speed infraction is scored afterwards, against the
expert's speed on the same episode (`stack.metrics.driving.min_speed_penalty`). Our world has no traffic
lights, stop signs or emergency vehicles, so CARLA's red-light, stop and yield infractions have no
counterpart here.
"""

from __future__ import annotations

import math
import numpy as np

from stack.metrics.driving import AT_FAULT_KINDS, boxes_overlap, collision_kind

BLOCKED_SPEED = 0.5
"""m/s: an ego slower than this is standing (CARLA's AgentBlockedTest threshold)."""
EXPERT_MOVES_M = 1.0
"""The expert 'would move on' when its plan from the ego's state goes at least this far within its horizon."""


class RouteMonitor:
    """Watches one episode step by step; `check` returns the event that ends it, or None."""

    def __init__(self, world, drive, ego_size: tuple, rear_offset: float):
        self.world, self.ego_size, self.rear_offset = world, ego_size, rear_offset
        self.blocked_steps = max(1, int(round(drive.blocked_seconds / world.dt)))
        self.route_deviation_m = drive.route_deviation_m
        self.standing_steps = 0
        """Consecutive steps, up to now, of standing where the expert would drive on."""

    def check(self, state, time_s: float) -> dict | None:
        centre = (state.x + self.rear_offset * math.cos(state.yaw), state.y + self.rear_offset * math.sin(state.yaw))
        return (self._collision(state, centre, time_s) or self._deviation(centre, time_s)
                or self._blocked(state, centre, time_s))

    def _collision(self, state, centre, time_s: float) -> dict | None:
        agents = self.world.agents_now()
        boxes = np.asarray(agents["boxes"], np.float64).reshape(-1, 5)
        if not len(boxes):
            return None
        ego = np.array([centre[0], centre[1], state.yaw, *self.ego_size], np.float64)
        for index in np.flatnonzero(boxes_overlap(ego[None], boxes)):
            kind = collision_kind(ego, state.speed, boxes[index], float(agents["speed"][index]),
                                  bool(agents["static"][index]))
            if kind in AT_FAULT_KINDS:
                return _event("collision", time_s, centre, f"at-fault collision ({kind}) with "
                              f"{'a parked ' if agents['static'][index] else 'a '}{agents['classes'][index]}",
                              actor=int(agents["track_ids"][index]), actor_class=agents["classes"][index])
        return None

    def _deviation(self, centre, time_s: float) -> dict | None:
        on_route, _ = self.world.ego_route.at(self.world.route_progress())
        off = float(math.hypot(centre[0] - on_route[0], centre[1] - on_route[1]))
        if off > self.route_deviation_m:
            return _event("route_deviation", time_s, centre, f"{off:.1f} m from the route "
                          f"(more than drive.route_deviation_m={self.route_deviation_m:g})")
        return None

    def _blocked(self, state, centre, time_s: float) -> dict | None:
        if state.speed >= BLOCKED_SPEED or not self._expert_moves_on():
            self.standing_steps = 0
            return None
        self.standing_steps += 1
        if self.standing_steps < self.blocked_steps:
            return None
        seconds = self.blocked_steps * self.world.dt
        return _event("blocked", time_s, centre, f"stood for {seconds:g} s where the expert would drive on")

    def _expert_moves_on(self) -> bool:
        """Whether the expert's plan from the ego's state goes at least EXPERT_MOVES_M within its horizon."""
        plan = np.asarray(self.world.expert_plan(), np.float64)
        return bool(len(plan)) and float(np.hypot(*plan[-1])) >= EXPERT_MOVES_M


def _event(kind: str, time_s: float, centre, what: str, **actor) -> dict:
    return {"kind": kind, "time_s": round(float(time_s), 6), "x": float(centre[0]), "y": float(centre[1]),
            "what": what, **actor}
