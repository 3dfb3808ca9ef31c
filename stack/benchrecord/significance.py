"""Is a figure faster, slower or the same? A verdict that accounts for noise.

The rule, after asv's `asv compare` (`asv/statistics.py: is_different`, and its `--factor`):

1. The ratio of medians (candidate / baseline) within `MIN_EFFECT` (3%) of 1 is "same", however significant:
   a shared 2-core machine moves medians by more than that between runs.
2. A figure whose samples are all equal on both sides is exact (bytes, a prediction): any change beyond the
   minimum effect is real.
3. Otherwise the Mann-Whitney U rank test (two-sided; Mann & Whitney, Ann. Math. Statist. 18, 1947) on the
   two sets of samples must give p < `ALPHA` (0.01). It assumes nothing about the shape of the noise, which
   for timings is skewed (other load only ever adds time). When the sample counts are too small for any
   ordering to reach p < ALPHA (smallest p = 2 / C(n + m, n)), the verdict is "inconclusive": asv skips
   the rank test in that case too (and falls back to asking whether 99% intervals overlap).

The ratio's interval is a percentile bootstrap (Efron 1979) of the ratio of medians at the same
confidence, 1 - ALPHA, resampling each side (`BOOTSTRAP_RESAMPLES`, a fixed seed, so a comparison prints
the same interval every time). The test assumes the samples are independent; the samples of one run on a
busy machine are not (other load moves them together), so a verdict between two single records says that
these two runs differ, not yet that the code does. A step over several records per commit
(`stack.benchrecord.steps`, which tests the runs' medians) is the evidence about the code.
"""

from __future__ import annotations

import dataclasses
import math

from stack.benchrecord.figures import Figure

ALPHA = 0.01
"""Significance level of the rank test (two-sided)."""
MIN_EFFECT = 0.03
"""A change of the median under this fraction is "same"."""
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_CHUNK = 1_000_000
"""Values drawn at once by the bootstrap (8 MB): a figure holds up to `figures.MAX_SAMPLES` samples."""
TIME_UNITS = ("s", "ms", "us", "ns")


@dataclasses.dataclass(frozen=True)
class Verdict:
    word: str
    """faster / slower (times and rates), better / worse (other units), same, inconclusive."""
    ratio: float
    """Candidate median / baseline median."""
    interval: tuple[float, float]
    p: float | None
    """The rank test's p-value; None for exact figures."""
    why: str

    @property
    def regression(self) -> bool:
        return self.word in ("slower", "worse")


def change_word(unit: str, lower_is_better: bool, ratio: float) -> str:
    """The word for a real change of this ratio: 'faster'/'slower' for times and rates, else 'better'/'worse'."""
    improved = ratio < 1 if lower_is_better else ratio > 1
    timed = unit in TIME_UNITS or unit.endswith("/s")
    return ("faster" if improved else "slower") if timed else ("better" if improved else "worse")


def within_min_effect(ratio: float) -> bool:
    return abs(math.log(ratio)) < math.log1p(MIN_EFFECT) if 0 < ratio < math.inf else False


def rank_test_p(first, second) -> float:
    """Two-sided Mann-Whitney U p-value (scipy: exact for small samples without ties, else the normal
    approximation with tie correction)."""
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(first, second, alternative="two-sided").pvalue)


def smallest_p(n: int, m: int) -> float:
    """The smallest two-sided p the rank test can give for sample counts n and m (complete separation)."""
    return min(1.0, 2 / math.comb(n + m, n))


def median_ratio(baseline, candidate) -> float:
    import numpy as np

    base, cand = float(np.median(baseline)), float(np.median(candidate))
    if base == 0:
        return 1.0 if cand == 0 else math.inf
    return cand / base


def ratio_interval(baseline, candidate, confidence: float = 1 - ALPHA) -> tuple[float, float]:
    """Percentile bootstrap interval of the ratio of medians (seeded: the same numbers on every call)."""
    import numpy as np

    rng = np.random.default_rng(0)
    base, cand = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    base_medians, cand_medians = _resampled_medians(rng, base), _resampled_medians(rng, cand)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(base_medians == 0, np.where(cand_medians == 0, 1.0, np.inf), cand_medians / base_medians)
    low, high = np.quantile(ratios, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def _resampled_medians(rng, samples):
    """The medians of `BOOTSTRAP_RESAMPLES` resamples of `samples`, drawn `BOOTSTRAP_CHUNK` values at a time, so that
    a figure of many samples costs time, not resamples x samples of memory at once."""
    import numpy as np

    rows = max(1, BOOTSTRAP_CHUNK // samples.size)
    sizes = [min(rows, BOOTSTRAP_RESAMPLES - start) for start in range(0, BOOTSTRAP_RESAMPLES, rows)]
    return np.concatenate([np.median(rng.choice(samples, (size, samples.size)), axis=1) for size in sizes])


def compare_figures(baseline: Figure, candidate: Figure) -> Verdict:
    """The verdict on `candidate` against `baseline` (the same figure from two records)."""
    ratio = median_ratio(baseline.samples, candidate.samples)
    interval = ratio_interval(baseline.samples, candidate.samples)
    changed = change_word(candidate.unit, candidate.lower_is_better, ratio)
    if within_min_effect(ratio):
        return Verdict("same", ratio, interval, None, f"median within {MIN_EFFECT:.0%}")
    if baseline.constant and candidate.constant:
        return Verdict(changed, ratio, interval, None, "exact figure (no spread on either side)")
    n, m = len(baseline.samples), len(candidate.samples)
    if smallest_p(n, m) >= ALPHA:
        return Verdict("inconclusive", ratio, interval, None,
                       f"{n} and {m} samples cannot reach p < {ALPHA:g} (5 and 5 can)")
    p = rank_test_p(baseline.samples, candidate.samples)
    if p >= ALPHA:
        return Verdict("same", ratio, interval, p, f"not significant (p >= {ALPHA:g})")
    return Verdict(changed, ratio, interval, p, f"p < {ALPHA:g}, change beyond {MIN_EFFECT:.0%}")
