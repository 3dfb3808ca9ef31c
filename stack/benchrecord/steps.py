"""Step detection: at which commit did a figure change, over a history of records?

The method, chosen to be simple enough to state in one paragraph and to share the comparison's test:
circular binary segmentation (Olshen, Venkatraman, Lucito & Wigler 2004, "Circular binary segmentation for
the analysis of array-based DNA copy number data", Biostatistics 5(4)) with the Mann-Whitney rank test as
its statistic, a rank-based change-point test in the spirit of Pettitt (1979, "A non-parametric approach to
the change-point problem", Applied Statistics 28(2)).

- The unit is the run: each record counts once, by the median of its samples. The samples of one run share
  that run's conditions (other load on a shared machine moves all of them together), so testing them as
  independent makes one disturbed run a "significant" step (measured: docs/log/2026-11-28_history-over-commits.md).
  asv detects steps on per-commit values for the same reason.
- The records of a figure, oldest first, are grouped by consecutive commit (several runs of one commit
  stay together; a step can only fall between commits).
- Every contiguous run of commits is tested against all the others (a segment touching either end is a
  single split: before against after; one in the middle is a change and a change back, which a single
  split would dilute: a slowdown fixed five commits later). The p-value is multiplied by the number of
  segments tried (Bonferroni), so that trying many does not manufacture a step. An exact figure (constant
  inside and outside, as bytes are) needs no test. The segment with the smallest p wins if that p is below
  `significance.ALPHA` and its ratio of medians against the rest is beyond `significance.MIN_EFFECT`; its
  ends are the steps.
- The pieces are then searched the same way, so a history with several steps names each.

asv (`asv/step_detect.py`) fits a piecewise-constant function with an L1 cost and a complexity penalty
instead (Friedrich et al. 2008, "Complexity penalized M-estimation: fast computation", J. Comput. Graph.
Stat. 17(1)); that finds several steps in one fit and weighs each by its size, at the price of a penalty
to tune. Ours needs no tuning and says how sure it is (p), at the price of needing several records: a rank
test over n + m runs cannot go below 2 / C(n + m, n), so a history of one run a commit over six commits
can name no step at all (`unresolvable` says so; three runs a commit can).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from stack.benchrecord.significance import ALPHA, median_ratio, rank_test_p, smallest_p, within_min_effect


@dataclasses.dataclass(frozen=True)
class Step:
    index: int
    """The first point (record) after the change, in the series given to `find_steps`."""
    commit: str
    ratio: float
    """Median after / median before, each side reaching to the neighbouring step (or the end)."""
    p: float
    """Bonferroni-corrected rank-test p-value of the split."""


def find_steps(series: Sequence[tuple[str, Sequence[float]]]) -> list[Step]:
    """The steps in `series`, (commit, samples) per record oldest first, in the order they happened."""
    groups = _by_commit(series)
    return _between_neighbours(groups, _segment(groups))


def unresolvable(series: Sequence[tuple[str, Sequence[float]]]) -> str:
    """Why no step could be named in `series` however large, or "" when the history has runs enough: the best
    segment the rank test can reach (all runs inside it faster than all outside) must clear `ALPHA` after the
    Bonferroni factor; constant figures (bytes) need no test."""
    groups = _by_commit(series)
    if all(min(samples) == max(samples) for _, samples in series):  # exact: one level against another is certain
        return ""
    if len(groups) < 2:
        return "one commit: no boundary to test"
    counts = [len(points) for _, _, points in groups]
    runs, tried = sum(counts), segments(len(groups))
    best = min(smallest_p(sum(counts[first:stop]), runs - sum(counts[first:stop])) for first, stop in tried) * len(tried)
    if best < ALPHA:
        return ""
    return (f"{runs} runs over {len(groups)} commits cannot name a step: the rank test over runs reaches at best "
            f"p = {best:.2g} after Bonferroni (alpha {ALPHA:g}); record each commit 3 times or more")


def _by_commit(series) -> list:
    """(commit, index of its first record, [median of each of its records]) per consecutive commit."""
    import numpy as np

    groups = []
    for index, (commit, samples) in enumerate(series):
        point = float(np.median(samples))
        if groups and groups[-1][0] == commit:
            groups[-1][2].append(point)
        else:
            groups.append((commit, index, [point]))
    return groups


def _segment(groups: list) -> list[Step]:
    best = _best_segment(groups)
    if best is None:
        return []
    (first, stop), p = best
    cuts = [cut for cut in (first, stop) if 0 < cut < len(groups)]
    pieces = [0, *cuts, len(groups)]
    steps = [Step(groups[cut][1], groups[cut][0], 1.0, p) for cut in cuts]
    found = _segment(groups[pieces[0]:pieces[1]])
    for i, step in enumerate(steps):
        found += [step] + _segment(groups[pieces[i + 1]:pieces[i + 2]])
    return found


def _between_neighbours(groups: list, steps: list[Step]) -> list[Step]:
    """Each step's ratio measured between the steps on either side of it (the level it left and the one it
    reached), rather than over the whole segment in which it was found."""
    starts = [index for index, (_, first, _) in enumerate(groups) if first in {step.index for step in steps}]
    bounds = [0, *starts, len(groups)]
    return [dataclasses.replace(step, ratio=median_ratio(_pooled(groups[bounds[i]:bounds[i + 1]]),
                                                         _pooled(groups[bounds[i + 1]:bounds[i + 2]])))
            for i, step in enumerate(steps)]


def _pooled(groups: list) -> list[float]:
    return [point for _, _, points in groups for point in points]


def segments(count: int) -> list[tuple[int, int]]:
    """Every contiguous run [first, stop) of `count` groups that leaves something outside it."""
    return [(first, stop) for first in range(count) for stop in range(first + 1, count + 1)
            if (first, stop) != (0, count)]


def _best_segment(groups: list) -> tuple[tuple[int, int], float] | None:
    """((first, stop), p) of the most significant segment of `groups` against the rest, or None when none is."""
    tried = segments(len(groups))
    best = None
    for first, stop in tried:
        inside, outside = _pooled(groups[first:stop]), _pooled(groups[:first] + groups[stop:])
        ratio = median_ratio(outside, inside)
        if within_min_effect(ratio):
            continue
        exact = min(inside) == max(inside) and min(outside) == max(outside)  # two constant levels: certain
        p = 0.0 if exact else min(1.0, rank_test_p(outside, inside) * len(tried))
        if p < ALPHA and (best is None or p < best[1] or (p == best[1] and _size(ratio) > best[2])):
            best = ((first, stop), p, _size(ratio))
    return None if best is None else best[:2]


def _size(ratio: float) -> float:
    return abs(math.log(ratio)) if 0 < ratio < math.inf else math.inf
