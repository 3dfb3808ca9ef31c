"""Step detection names the commit where a figure changed, on synthetic histories."""

from synthetic_records import noisy

from stack.benchrecord.steps import find_steps, unresolvable


def history(levels: list[float], seed: int = 0, runs: int = 3) -> list[tuple[str, list[float]]]:
    """`runs` records a commit, each of 7 samples around its commit's level."""
    return [(f"commit{i:02d}", noisy(level, seed=seed + 100 * run + i)) for i, level in enumerate(levels)
            for run in range(runs)]


def test_the_commit_where_a_figure_got_slower_is_named():
    steps = find_steps(history([1.0] * 6 + [1.5] * 4))
    assert [(step.index, step.commit) for step in steps] == [(18, "commit06")]
    assert 1.4 < steps[0].ratio < 1.6 and steps[0].p < 0.01


def test_a_flat_history_has_no_step():
    assert find_steps(history([1.0] * 10, seed=50)) == []


def test_a_slowdown_and_a_later_fix_are_both_named():
    steps = find_steps(history([1.0] * 5 + [2.0] * 5 + [1.0] * 5, seed=20))
    assert [step.commit for step in steps] == ["commit05", "commit10"]
    assert steps[0].ratio > 1.5 and steps[1].ratio < 0.7


def test_records_of_one_commit_stay_together():
    """Runs of the same commit are one point in time: the step falls at the commit, never between its runs."""
    series = [(commit, noisy(level, seed=10 * i + run)) for i, (commit, level, runs) in
              enumerate([("a", 1.0, 4), ("b", 1.0, 3), ("c", 2.0, 3), ("d", 2.0, 4)]) for run in range(runs)]
    assert [(step.index, step.commit) for step in find_steps(series)] == [(7, "c")]


def test_one_disturbed_run_is_not_a_step():
    """The run is the unit: a run whose every sample is slow (another job shared the cores) is one point, not
    seven. Testing samples as independent named a step here, as it did on a real history."""
    series = history([1.0] * 6, seed=7)
    series[8] = (series[8][0], noisy(1.3, seed=99))
    assert find_steps(series) == []


def test_one_run_a_commit_cannot_name_a_step_and_says_so():
    series = history([1.0] * 3 + [2.0] * 3, runs=1)
    assert find_steps(series) == []
    assert "6 runs over 6 commits cannot name a step" in unresolvable(series)
    assert "record each commit 3 times" in unresolvable(series)
    assert unresolvable(history([1.0] * 3 + [2.0] * 3)) == ""


def test_an_exact_figure_steps_where_its_value_changes():
    series = [(f"c{i}", [100.0]) for i in range(3)] + [(f"c{i}", [130.0]) for i in range(3, 5)]
    assert [step.commit for step in find_steps(series)] == ["c3"]
