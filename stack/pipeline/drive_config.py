"""`drive` and `dagger`: closed-loop evaluation in the simulator, and fine-tuning on the states the student visits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from stack.pipeline.checks import Problems, bounded, in_range, positive
from stack.pipeline.target_config import MAX_EPISODE_SECONDS, MAX_EPISODES, MAX_LATENCY_MS


DRIVE_SCENARIOS = ("route", "lead_brake", "stopped_vehicle", "zebra_crossing", "jaywalker", "unprotected_turn", "cut_in")
"""Scenario families of the closed loop (`stack.sim.scenarios` builds them)."""
DRIVE_BASELINES = ("expert", "constant_velocity", "ego_rollout")
"""Policies that need no network: the privileged expert (upper bound) and two blind ones."""


@dataclass
class DaggerConfig:
    """`stack dagger`: the student drives training episodes, the expert labels the states it visits, the
    student is fine-tuned on everything recorded so far (DAgger, Ross, Gordon & Bagnell, AISTATS 2011)."""

    out_dir: str = "runs/dagger"
    """Folder for each iteration's recorded dataset and fine-tuned weights, the summary and its plot."""
    iterations: int = 3
    """Rounds of drive -> label -> aggregate -> fine-tune."""
    episodes: int = 28
    """Training episodes the student drives per iteration (new worlds each iteration; never evaluation ones)."""
    beta: float = 0.5
    """Share of replanning instants the expert drives in the first iteration (Ross et al.'s beta_1)."""
    beta_decay: float = 0.5
    """beta_i = beta * beta_decay^(i-1): the student takes over as it improves."""
    steps: int = 150
    """Fine-tuning steps per iteration, on data.root's train split plus every recorded iteration."""
    lr_scale: float = 1.0
    """Each fine-tuning's peak learning rate as a share of train.lr (warmed up and decayed over dagger.steps as
    training's is). 1.0 restarts the schedule at full size on weights that have converged; fine-tuning usually
    starts lower, so that a few hundred new frames adjust the network rather than retrain it."""
    overwrite: bool = False
    """Start over in an out_dir that holds an earlier DAgger run (else it is refused)."""

    def problems(self) -> Problems:
        found: Problems = []
        in_range(found, "iterations", self.iterations, 1, 100)
        in_range(found, "episodes", self.episodes, 1, 100_000)
        in_range(found, "beta", self.beta, 0.0, 1.0)
        in_range(found, "beta_decay", self.beta_decay, 0.0, 1.0)
        in_range(found, "steps", self.steps, 1, 10_000_000)
        if not 0.0 < self.lr_scale <= 1.0:
            found.append(("lr_scale", f"got {self.lr_scale!r}; a share of train.lr in (0, 1], e.g. 0.1"))
        return found


DRIVE_SPLITS = ("evaluation", "tuning")
"""The worlds `stack drive` can drive (`stack.sim.scenarios.SPLIT_WORDS`; training worlds are recorded, not driven)."""


@dataclass
class DriveConfig:
    """Closed-loop evaluation (`stack drive`): a policy drives the ego in the rendered world."""

    out_dir: str = "runs/drive"
    """Folder for drive.md / drive.json / drive.png and the clips."""
    scenarios: List[str] = field(default_factory=lambda: list(DRIVE_SCENARIOS))
    """Scenario families to drive, from DRIVE_SCENARIOS."""
    episodes: int = 56
    """Episodes per policy, spread round-robin over the families and then the seeds."""
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])
    """Evaluation seeds: each gives other instances of every family (held out: training scenes never use
    them); results are mean +/- std over seeds."""
    split: str = "evaluation"
    """Which worlds: "evaluation", the held-out episodes every reported figure comes from; or "tuning", other
    worlds of the same families, neither trained nor evaluated on, for choosing settings (such as
    guard.score) without looking at the evaluation episodes."""
    episode_seconds: float = 8.0
    """Simulated length of an episode."""
    sim_hz: float = 10.0
    """Simulation rate: the ego's vehicle model, the controller and the other road users step at it."""
    replan_hz: float = 2.0
    """Camera and replanning rate; sim_hz / replan_hz must be a whole number."""
    latency_ms: float = -1.0
    """Delay before a network's plan reaches the controller; -1: measured on this host for ONNX Runtime
    bundles and checkpoints, the latency model's prediction for TensorRT targets."""
    baselines: List[str] = field(default_factory=lambda: list(DRIVE_BASELINES))
    """Baseline policies driven beside the network, from DRIVE_BASELINES."""
    workers: int = 2
    """Worker processes that run episodes in parallel (one torch / ONNX Runtime thread each)."""
    clips: int = 2
    """MP4 clips written per policy, of its worst episodes (lowest driving score)."""
    best_clips: int = 0
    """MP4 clips written per policy and scenario family, of its best episodes there (highest driving score, then
    PDMS): what the policy does with each family's hazard when it gets it right (the stopped car braked for, the
    junction turned), beside the worst episodes' clips that show what goes wrong."""
    blocked_seconds: float = 3.0
    """An episode ends as blocked when the ego stands (under 0.5 m/s) for this long while at every step the
    privileged expert would drive on (CARLA's agent-blocked rule, scaled to our seconds-long episodes; stack.sim.infractions)."""
    route_deviation_m: float = 10.0
    """An episode ends when the ego's centre is farther than this from its route's centreline (CARLA's
    route-deviation rule; our roads are 12 m wide)."""

    def problems(self) -> Problems:
        found: Problems = []
        unknown = [s for s in self.scenarios if s not in DRIVE_SCENARIOS]
        if unknown or not self.scenarios:
            found.append(("scenarios", f"got {list(self.scenarios)!r}; choose from {', '.join(DRIVE_SCENARIOS)}"))
        unknown = [b for b in self.baselines if b not in DRIVE_BASELINES]
        if unknown:
            found.append(("baselines", f"got {list(self.baselines)!r}; choose from {', '.join(DRIVE_BASELINES)}"))
        if self.split not in DRIVE_SPLITS:
            found.append(("split", f"got {self.split!r}; choose {' or '.join(DRIVE_SPLITS)}"))
        if not self.seeds:
            found.append(("seeds", "got an empty list; give at least one evaluation seed"))
        for name in ("episodes", "episode_seconds", "sim_hz", "replan_hz", "blocked_seconds", "route_deviation_m"):
            positive(found, name, getattr(self, name))
        if self.sim_hz > 0 and self.replan_hz > 0:
            ratio = self.sim_hz / self.replan_hz
            if abs(ratio - round(ratio)) > 1e-6 or round(ratio) < 1:
                found.append(("replan_hz", f"got {self.replan_hz} with sim_hz {self.sim_hz}; sim_hz / replan_hz must "
                                           f"be a whole number >= 1 (e.g. 2, 5 or 10 Hz at 10 Hz)"))
        if self.replan_hz > 0 and 0 < self.episode_seconds < 2.0 / self.replan_hz:
            found.append(("episode_seconds", f"got {self.episode_seconds} with replan_hz {self.replan_hz}: an episode "
                                             f"must last at least two replanning periods ({2.0 / self.replan_hz:g} s) "
                                             f"for a plan to be driven and scored; e.g. 8 s"))
        if self.latency_ms < 0 and self.latency_ms != -1:
            found.append(("latency_ms", f"got {self.latency_ms}; use -1 (measure / predict) or a delay >= 0 ms"))
        elif self.latency_ms > MAX_LATENCY_MS:
            found.append(("latency_ms", f"got {self.latency_ms}; a plan that arrives after {MAX_LATENCY_MS:g} ms is never "
                                        f"driven in an episode of seconds: use at most {MAX_LATENCY_MS:g}"))
        bounded(found, self, (
            ("episodes", MAX_EPISODES, "(days of driving on a CPU); e.g. 56"),
            ("episode_seconds", MAX_EPISODE_SECONDS, "s (the scenarios stage their event in the first seconds); e.g. 8"),
            ("sim_hz", 1_000.0, "Hz (the vehicle model is stable at 10 Hz); e.g. 10"),
            ("seeds", 1_000, "seeds (each multiplies the episodes' worlds); e.g. [0, 1, 2]"),
            ("clips", 1_000, "clips per policy (each is an MP4 of an episode); e.g. 2"),
            ("best_clips", 100, "clips per policy and family (each is an MP4 of an episode); e.g. 1")))
        in_range(found, "workers", self.workers, 0, 64)
        for name in ("clips", "best_clips"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; must be >= 0"))
        return found
