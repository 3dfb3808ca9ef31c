"""The closed-loop gate's budgets and episode count, derived from measured spreads rather than chosen.

**Budgets.** INT8 may cost no more driving than retraining the same recipe typically moves it: the root mean
square of the difference between two training seeds of one configuration, driven on the same held-out
episodes (`SEED_PAIRS`, listed in docs/log/2026-11-28_closed-loop-budgets.md). A quantized network inside that
budget is, as far as the closed loop can tell, the network the recipe makes; one outside it is a different
network. The same rule gives the at-fault collision budget from the same pairs. It is the rule of the head bars
(`stack.metrics.bars`: derived from repeated recipe runs), applied to the drop instead of the level.

**Episodes.** A power calculation: enough episodes that a drop of the budget's size is told from none with
probability `POWER`, one-sided at the upper end of the gate's 90% paired interval (the gate's own rule),

    n = ((z_0.95 + z_0.90) x sd / budget)^2

where sd is the per-episode standard deviation of the paired driving-score difference. Under a real drop INT8
is a different network, so sd is measured between different networks on the same episodes (`NETWORK_PAIRS`:
sd = the 90% interval's half-width / 1.645 x sqrt(episodes)), not between INT8 and fp32 of a faithful
quantization, whose near-identical drives would make any count look sufficient. Rounded up to whole rounds
of the scenario families, so every family is driven equally often.

Sources for the method: Cohen (1988), "Statistical Power Analysis for the Behavioral Sciences", ch. 2 (the
paired-difference sample size); the spread between seeds as a quality budget: Henderson et al. (2018), "Deep
Reinforcement Learning that Matters" (seeds move a policy's score as much as a method change does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

LEVEL = 0.90
"""The gate's paired interval (two-sided 90%: the drop is judged at its one-sided 95% upper end)."""
POWER = 0.90
"""Probability of telling a drop of the budget's size from none."""
FAMILIES = 7
"""Scenario families of `drive.scenarios` (episodes come in whole rounds of them)."""


@dataclass(frozen=True)
class SeedPair:
    """Two training seeds of one configuration, the same 56 held-out episodes, the same drive settings."""

    what: str
    driving_score: tuple[float, float]
    collisions_per_episode: tuple[float, float] | None
    """At-fault collisions per episode (a crash ends the drive: the share of drives ended by one); None where
    the log entries of the pair do not give them."""


@dataclass(frozen=True)
class PairedInterval:
    """The 90% paired-bootstrap interval of the driving-score difference between two different networks."""

    what: str
    episodes: int
    low: float
    high: float

    @property
    def per_episode_sd(self) -> float:
        z = NormalDist().inv_cdf(1 - (1 - LEVEL) / 2)
        return (self.high - self.low) / (2 * z) * math.sqrt(self.episodes)


SEED_PAIRS = (
    SeedPair("tiny-drive k=0, fp32, AVX2 EPYC, no guard", (0.702, 0.565), None),
    SeedPair("tiny-drive k=1, fp32, AVX2 EPYC, no guard", (0.551, 0.662), None),
    SeedPair("tiny-drive k=1, 2052 steps, bf16, no guard", (0.701, 0.659), (34 / 56, 41 / 56)),
    SeedPair("tiny-drive k=1, 2052 steps, guard 0.2 + restart 0.5 s", (0.704, 0.708), (9 / 56, 17 / 56)),
    SeedPair("tiny-drive k=1, 4104 steps, guard 0.15 + restart 0.5 s", (0.752, 0.716), (9 / 56, 9 / 56)),
)
"""Held-out driving score (and drives ended by a collision) of seeds 0 and 1
(docs/log/2026-11-28_closed-loop-budgets.md)."""

NETWORK_PAIRS = (
    PairedInterval("4104 against 2052 steps (seed 0, guard 0.15)", 56, 0.024, 0.121),
    PairedInterval("4104 steps against 2052 at its own guard (seed 0)", 56, -0.007, 0.102),
    PairedInterval("velocity loss 1.0 against the preset (seed 0)", 56, -0.103, -0.000),
    PairedInterval("4104 against 2052 steps (seed 1)", 56, -0.045, 0.060),
    PairedInterval("yaw rate in the ego status against the chord rule", 56, -0.057, 0.052),
)
"""Paired driving-score differences between two trained networks, 56 episodes
(docs/log/2026-11-28_closed-loop-budgets.md)."""


def root_mean_square_difference(pairs) -> float:
    differences = [a - b for a, b in pairs]
    return math.sqrt(sum(d * d for d in differences) / len(differences))


def driving_score_budget() -> float:
    """The driving-score drop INT8 may cost: the RMS difference between two seeds, to two decimals."""
    return round(root_mean_square_difference([pair.driving_score for pair in SEED_PAIRS]), 2)


def collision_budget() -> float:
    """The rise in at-fault collisions per episode INT8 may cause, by the same rule."""
    return round(root_mean_square_difference([pair.collisions_per_episode for pair in SEED_PAIRS
                                              if pair.collisions_per_episode is not None]), 2)


def per_episode_spread() -> float:
    """The per-episode SD of the paired driving-score difference between two networks (root mean square)."""
    return math.sqrt(sum(pair.per_episode_sd ** 2 for pair in NETWORK_PAIRS) / len(NETWORK_PAIRS))


def _z_sum() -> float:
    z = NormalDist().inv_cdf
    return z(1 - (1 - LEVEL) / 2) + z(POWER)


def episodes_needed(budget: float | None = None, spread: float | None = None) -> int:
    """Episodes that tell a drop of `budget` from none with probability POWER, in whole rounds of the families."""
    budget = driving_score_budget() if budget is None else budget
    spread = per_episode_spread() if spread is None else spread
    raw = (_z_sum() * spread / budget) ** 2
    return FAMILIES * math.ceil(raw / FAMILIES)


def power(episodes: int, budget: float, spread: float | None = None) -> float:
    """The probability that `episodes` tell a real drop of `budget` from none (one-sided at the interval's
    upper end), at the per-episode spread measured between networks."""
    if episodes <= 0 or budget <= 0:
        return 0.0
    spread = per_episode_spread() if spread is None else spread
    z = NormalDist()
    return z.cdf(budget / (spread / math.sqrt(episodes)) - z.inv_cdf(1 - (1 - LEVEL) / 2))


def derivation_line(episodes: int, budget: float) -> str:
    """What the report says about how sure a drive of `episodes` is, against the derived figures."""
    derived = (driving_score_budget(), episodes_needed())
    return (f"Power: {episodes} episodes tell a real driving-score drop of {budget:g} from none with probability "
            f"{power(episodes, budget):.0%} (per-episode spread between two networks {per_episode_spread():.3f}); the "
            f"derived budget is {derived[0]:g} (the RMS difference between two training seeds) and {derived[1]} "
            f"episodes give {POWER:.0%} (stack.deploy.gates.closed_loop_budget).")
