"""`guard`: the plan's post-processing, the rules between the planner's candidates and the car.

The plan guard (`stack.models.plan_guard`) is not the network: it reads the network's decoded detections and drops
the candidates that run into them. It is what a network drives *with*, so it has a section of its own: a checkpoint
drives with any guard (an experiment), while a deploy bundle records the guard its closed-loop gate drove with
(gate.json's `post_processing`), `stack deploy --verify` checks it, and the bundle's runtime plans with exactly that
(`stack.deploy.runner.DeployedNetwork.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from stack.pipeline.checks import Problems

GUARD_EMERGENCY_DECELERATION = 6.0
"""m/s^2 the room-to-stop rule (`guard.reaction_s`) brakes at: the world's car brakes at up to 8 m/s^2 but reaches
it at its 10 m/s^3 jerk limit only after 0.8 s (`stack.sim.vehicle.VehicleLimits`); the expert's hardest is 7."""
GUARD_STANDOFF_M = 2.0
"""Metres short of a detection the room-to-stop rule must be able to stop the car (RSS's minimum distance; an
adaptive cruise control's standstill gap): braking as late as possible otherwise leaves no room for the detector's
placement error along the ray or the controller's lag, and the car creeps into the stopped car it has braked for."""


@dataclass
class GuardConfig:
    """The plan guard (`stack.models.plan_guard`): which candidates of the planner the car may drive."""

    score: float = 0.0
    """0: the network drives its planner's best-scoring candidate (the guard is off, and its rules below with it:
    this one key switches a preset's guard off). Otherwise the best one whose footprint runs into none of the
    network's own detections scoring at least this, moved at their detected velocities (InterFuser's safety
    controller on our outputs); closed loop only."""
    deceleration: float = 3.5
    """m/s^2: the guard also drops a candidate that could not stop at this rate after its horizon."""
    restart_s: float = 0.0
    """0: off. Otherwise, once the ego has stood this many seconds and the guarded choice would still not move it,
    the best-scoring candidate that moves on and runs into no detection drives (the inertia problem)."""
    reaction_s: float = 0.0
    """0: off. Otherwise the guard also drops a candidate after which the car could not stop GUARD_STANDOFF_M short of
    a detection (where it goes, or where it stands now) if it followed the candidate this many seconds and then
    braked at GUARD_EMERGENCY_DECELERATION: RSS's response time (`stack.models.plan_guard.braking_after_reaction`).
    One replanning period (0.5 s at 2 Hz) plus the latency from camera to controller, e.g. 0.6."""
    segmentation: float = 0.0
    """0: off. Otherwise the guard ignores a detection where the network's own segmentation sees no road user: one
    whose road-user probability stays below this in the central half of its image rectangle in every camera that
    sees it (`stack.models.plan_guard.segmentation_support`)."""
    depth: float = 0.0
    """0: off. Otherwise the guard ignores a detection where the network's own depth head puts no surface between its
    nearest corner and its centre, at the cell its centre projects to (`stack.models.plan_guard.depth_support`)."""

    def settings(self) -> dict:
        """Every setting by name, with the two constants of the room-to-stop rule when it is on: what a drive
        report and a bundle's gate.json record."""
        found = {name: float(getattr(self, name)) for name in GUARD_KEYS}
        if self.score and self.reaction_s:
            found.update(emergency_deceleration=GUARD_EMERGENCY_DECELERATION, standoff_m=GUARD_STANDOFF_M)
        return found

    def problems(self) -> Problems:
        found: Problems = []
        if not 0 <= self.score < 1:
            found.append(("score", f"got {self.score}; give 0 (no guard) or a detection score in (0, 1), e.g. 0.15"))
        if not 0 < self.deceleration <= 12:
            found.append(("deceleration", f"got {self.deceleration}; give a braking rate in m/s^2 within (0, 12], "
                                          f"e.g. 3.5"))
        if not 0 <= self.reaction_s <= 3:
            found.append(("reaction_s", f"got {self.reaction_s}; give 0 (off) or seconds within (0, 3]: a replanning "
                                        f"period plus the latency, e.g. 0.6"))
        if not 0 <= self.restart_s <= 10:
            found.append(("restart_s", f"got {self.restart_s}; give 0 (off) or seconds of standing within (0, 10], "
                                       f"e.g. 1"))
        for name, example in (("segmentation", "a road-user probability in (0, 1), e.g. 0.2"),
                              ("depth", "a depth-bin probability in (0, 1), e.g. 0.1")):
            if not 0 <= getattr(self, name) < 1:
                found.append((name, f"got {getattr(self, name)}; give 0 (off) or {example}"))
        return found


GUARD_KEYS = ("score", "deceleration", "restart_s", "reaction_s", "segmentation", "depth")
"""The guard's settings, in the order reports list them."""
