"""Step detection names the commit where a figure changed, on synthetic histories."""

from synthetic_records import noisy

from stack.benchrecord.steps import find_steps


def history(levels: list[float], seed: int = 0) -> list[tuple[str, list[float]]]:
    return [(f"commit{i:02d}", noisy(level, seed=seed + i)) for i, level in enumerate(levels)]


def test_the_commit_where_a_figure_got_slower_is_named():
    steps = find_steps(history([1.0] * 6 + [1.5] * 4))
    assert [(step.index, step.commit) for step in steps] == [(6, "commit06")]
    assert 1.4 < steps[0].ratio < 1.6 and steps[0].p < 0.01


def test_a_flat_history_has_no_step():
    assert find_steps(history([1.0] * 10, seed=50)) == []


def test_a_slowdown_and_a_later_fix_are_both_named():
    steps = find_steps(history([1.0] * 5 + [2.0] * 5 + [1.0] * 5, seed=20))
    assert [step.commit for step in steps] == ["commit05", "commit10"]
    assert steps[0].ratio > 1.5 and steps[1].ratio < 0.7


def test_records_of_one_commit_stay_together():
    """Two runs of the same commit are one point in time: the step falls at the commit, never between its runs."""
    series = [("a", noisy(1.0, seed=1)), ("a", noisy(1.0, seed=2)), ("b", noisy(1.0, seed=3)),
              ("c", noisy(2.0, seed=4)), ("c", noisy(2.0, seed=5)), ("d", noisy(2.0, seed=6))]
    assert [(step.index, step.commit) for step in find_steps(series)] == [(3, "c")]


def test_an_exact_figure_steps_where_its_value_changes():
    series = [(f"c{i}", [100.0]) for i in range(3)] + [(f"c{i}", [130.0]) for i in range(3, 5)]
    assert [step.commit for step in find_steps(series)] == ["c3"]
