"""The verdict on one figure: a real change is called, noise and small changes are not, too few samples say so."""

import pytest
from synthetic_records import noisy

from stack.benchrecord.figures import Figure
from stack.benchrecord.significance import ALPHA, MIN_EFFECT, compare_figures, smallest_p


def figure(samples, unit="s", lower_is_better=True):
    return Figure("op", tuple(samples), unit, lower_is_better)


def test_a_two_times_slower_sample_set_is_slower_with_the_ratio_in_its_interval():
    verdict = compare_figures(figure(noisy(1.0, seed=1)), figure(noisy(2.0, seed=2)))
    assert verdict.word == "slower" and verdict.regression
    assert verdict.p < ALPHA
    low, high = verdict.interval
    assert low < verdict.ratio < high and 1.7 < verdict.ratio < 2.3 and low > 1 + MIN_EFFECT


def test_two_draws_from_one_distribution_are_the_same():
    for seed in range(5):
        verdict = compare_figures(figure(noisy(1.0, n=9, seed=seed, spread=0.3)),
                                  figure(noisy(1.0, n=9, seed=100 + seed, spread=0.3)))
        assert verdict.word == "same" and not verdict.regression, (seed, verdict)


def test_half_the_time_is_faster_and_twice_the_rate_is_faster():
    assert compare_figures(figure(noisy(2.0, seed=3)), figure(noisy(1.0, seed=4))).word == "faster"
    rate = compare_figures(figure(noisy(100.0, seed=5), "samples/s", False), figure(noisy(200.0, seed=6), "samples/s", False))
    assert rate.word == "faster" and not rate.regression
    halved = compare_figures(figure(noisy(100.0, seed=5), "samples/s", False), figure(noisy(50.0, seed=6), "samples/s", False))
    assert halved.word == "slower" and halved.regression


def test_a_significant_change_under_the_minimum_effect_is_the_same():
    before, after = noisy(1.0, n=40, seed=7, spread=0.002), noisy(1.02, n=40, seed=8, spread=0.002)
    verdict = compare_figures(figure(before), figure(after))
    assert verdict.word == "same" and "within 3%" in verdict.why


def test_too_few_samples_for_the_rank_test_are_inconclusive_not_same():
    assert smallest_p(3, 3) >= ALPHA > smallest_p(5, 5)
    verdict = compare_figures(figure(noisy(1.0, n=3, seed=9)), figure(noisy(2.0, n=3, seed=10)))
    assert verdict.word == "inconclusive" and not verdict.regression


@pytest.mark.parametrize("old,new,word", [(100.0, 120.0, "worse"), (100.0, 80.0, "better"), (100.0, 100.0, "same")])
def test_exact_figures_need_no_test(old, new, word):
    verdict = compare_figures(figure([old], "MiB"), figure([new], "MiB"))
    assert verdict.word == word and verdict.p is None



def test_the_bootstrap_of_the_largest_figure_a_record_may_hold_draws_in_chunks(monkeypatch):
    """A figure may hold up to `records.MAX_SAMPLES` samples: the bootstrap draws them a chunk at a time, not
    resamples x samples at once (160 MB a side at the bound), and prints the interval it printed before."""
    import tracemalloc

    from stack.benchrecord import significance
    from stack.benchrecord.records import MAX_SAMPLES

    base, cand = noisy(1.0, n=MAX_SAMPLES, seed=1), noisy(1.1, n=MAX_SAMPLES, seed=2)
    tracemalloc.start()
    try:
        interval = significance.ratio_interval(base, cand)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * significance.BOOTSTRAP_CHUNK * 8, f"{peak / 2**20:.0f} MiB at once"
    monkeypatch.setattr(significance, "BOOTSTRAP_CHUNK", 10**9)
    assert significance.ratio_interval(base, cand) == interval, "the same draws, in one piece"
