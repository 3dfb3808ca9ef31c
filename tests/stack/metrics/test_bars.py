"""The head bars of `stack eval` and `stack deploy`: derived from the recipe's runs, and applied as stated."""

import pytest

from stack.metrics.bars import GAIN_SHARE, MIN_SPREADS, RECIPE, bar_ratio, verdicts

RECIPE_LIKE = {"planning/L2_at_3s": 0.68, "planning/baseline_cv/L2_at_3s": 2.13,
               "planning/baseline_ego_rollout/L2_at_3s": 0.854, "depth/AbsRel": 0.26,
               "depth/baseline_mean_depth/AbsRel": 0.806, "segmentation/mIoU": 0.66,
               "segmentation/baseline_majority/mIoU": 0.035, "detection/mAP": 0.22, "detection/baseline_empty/mAP": 0.0,
               "detection/NDS": 0.36, "detection/baseline_empty/NDS": 0.0}


def test_a_network_like_the_recipe_passes_and_one_with_a_fifth_less_gain_fails_every_head():
    assert all(row.passed for row in verdicts(RECIPE_LIKE))
    weaker = {}  # 70% of the recipe's gain over each baseline: below GAIN_SHARE (80%)
    for key, base in (("planning/L2_at_3s", "planning/baseline_ego_rollout/L2_at_3s"),
                      ("depth/AbsRel", "depth/baseline_mean_depth/AbsRel"),
                      ("segmentation/mIoU", "segmentation/baseline_majority/mIoU"),
                      ("detection/mAP", "detection/baseline_empty/mAP"),
                      ("detection/NDS", "detection/baseline_empty/NDS")):
        weaker[key] = RECIPE_LIKE[base] + 0.7 * (RECIPE_LIKE[key] - RECIPE_LIKE[base])
    rows = verdicts({**RECIPE_LIKE, **weaker})
    assert not any(row.passed for row in rows), [(r.head, r.value, r.threshold) for r in rows]
    assert not any(row.passed for row in verdicts({}))  # missing figures never pass
    assert not any(row.passed for row in verdicts({k: float("nan") for k in RECIPE_LIKE}))


@pytest.mark.parametrize("head", sorted(RECIPE))
def test_each_bar_follows_its_rule_and_leaves_every_recorded_recipe_run_room_to_pass(head):
    recipe = RECIPE[head]
    expected = recipe.baseline + GAIN_SHARE * (recipe.mean - recipe.baseline)
    applied = bar_ratio(head) * (recipe.baseline or 1.0)
    assert applied == pytest.approx(expected, abs=1e-3 * max(1.0, recipe.baseline))
    assert recipe.margin_in_spreads() >= MIN_SPREADS, (head, recipe.mean, recipe.spread, recipe.bar)
    lenient = (lambda run: run >= applied) if recipe.higher_is_better else (lambda run: run <= applied)
    assert all(lenient(run) for run in recipe.runs)


def test_planning_is_judged_against_its_prior_not_constant_velocity():
    """A planner that only repeats the ego-status rollout beats constant velocity 2.5x yet fails; one that
    removes 20% of the rollout's error passes."""
    base = {"planning/baseline_cv/L2_at_3s": 2.13, "planning/baseline_ego_rollout/L2_at_3s": 0.854}
    prior_only = {row.head: row for row in verdicts({**base, "planning/L2_at_3s": 0.854})}["planning"]
    assert not prior_only.passed and prior_only.baseline == 0.854 and "constant velocity 2.130 m" in prior_only.note
    learned = {row.head: row for row in verdicts({**base, "planning/L2_at_3s": 0.68})}["planning"]
    assert learned.passed and "0.32x" in learned.note
    assert learned.to_dict()["threshold"] == pytest.approx(bar_ratio("planning") * 0.854)


def test_boxes_found_but_placed_sized_or_turned_badly_fail_on_nds_alone():
    """NDS weighs the matched boxes' errors beside mAP: the same mAP with every TP error at its clip (1.0) scores
    NDS 0.5 mAP = 0.11, under the bar, while the detection row (mAP) still passes."""
    from stack.metrics.detection import nd_score

    poor = nd_score(RECIPE_LIKE["detection/mAP"], [1.0] * 5)
    rows = {row.head: row for row in verdicts({**RECIPE_LIKE, "detection/NDS": poor})}
    assert rows["detection"].passed and not rows["nuscenes"].passed
    assert rows["nuscenes"].metric == "NDS" and rows["nuscenes"].threshold == pytest.approx(bar_ratio("nuscenes"))
