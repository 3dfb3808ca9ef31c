"""The closed-loop gate's budgets and episode count are derived from measured spreads, and every target uses them."""

import math

import pytest
import yaml

from stack.deploy.gates import closed_loop_budget as derived
from stack.pipeline.target_config import TARGETS_DIR, ClosedLoopBudget


@pytest.mark.parametrize("path", sorted(TARGETS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_target_drives_the_derived_episodes_against_the_derived_budgets(path):
    closed_loop = yaml.safe_load(path.read_text())["closed_loop"]
    assert closed_loop["driving_score_drop"] == derived.driving_score_budget()
    assert closed_loop["collision_rise"] == derived.collision_budget()
    assert closed_loop["episodes"] == derived.episodes_needed()


def test_the_defaults_are_the_derived_budgets():
    budget = ClosedLoopBudget()
    assert (budget.driving_score_drop, budget.collision_rise) == (derived.driving_score_budget(),
                                                                   derived.collision_budget())


def test_the_budget_is_the_rms_difference_between_seeds():
    assert derived.root_mean_square_difference([(0.70, 0.60), (0.50, 0.50)]) == pytest.approx(math.sqrt(0.01 / 2))
    assert 0.0 < derived.driving_score_budget() < 0.15, "a drop the size of a retraining, not a free pass"


def test_the_derived_episodes_reach_the_power_and_one_round_fewer_does_not():
    budget, episodes = derived.driving_score_budget(), derived.episodes_needed()
    assert episodes % derived.FAMILIES == 0
    assert derived.power(episodes, budget) >= derived.POWER > derived.power(episodes - derived.FAMILIES, budget)
    assert derived.power(28, budget) < 0.6, "the recipe's 28 episodes are underpowered, and its report says so"


def test_the_spread_is_recovered_from_a_paired_interval():
    """A 90% interval of half-width 1.645 x SE over n episodes: the per-episode SD is SE x sqrt(n)."""
    interval = derived.PairedInterval("synthetic", 64, -1.645 * 0.03, 1.645 * 0.03)
    assert interval.per_episode_sd == pytest.approx(0.03 * 8, rel=1e-4)


def test_a_report_states_how_likely_its_episodes_were_to_catch_a_drop():
    line = derived.derivation_line(28, 0.08)
    assert "28 episodes tell a real driving-score drop of 0.08 from none with probability 55%" in line
    assert f"{derived.episodes_needed()} episodes give 90%" in line
