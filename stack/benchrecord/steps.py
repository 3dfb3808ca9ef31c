"""Step detection: at which commit did a figure change, over a history of records?

The method, chosen to be simple enough to state in one paragraph and to share the comparison's test:
binary segmentation (Scott & Knott 1974; Vostrikova 1981) with the Mann-Whitney rank test as the split
statistic, a rank-based single change-point test in the spirit of Pettitt (1979, "A non-parametric
approach to the change-point problem", Applied Statistics 28(2)).

- The records of a figure, oldest first, are grouped by consecutive commit (several runs of one commit
  stay together; a step can only fall between commits).
- For every boundary between groups, the samples of all records before it are tested against all after
  it; the p-value is multiplied by the number of boundaries tried (Bonferroni), so that trying many
  splits does not manufacture a step. An exact figure (constant on both sides, as bytes are) needs no test. The boundary with the smallest p wins if that p is below
  `significance.ALPHA` and the ratio of medians (after / before) is beyond `significance.MIN_EFFECT`.
- The two sides are then searched the same way, so a history with several steps names each.

asv (`asv/step_detect.py`) fits a piecewise-constant function with an L1 cost and a complexity penalty
instead (Friedrich et al. 2008, "Complexity penalized M-estimation: fast computation", J. Comput. Graph.
Stat. 17(1)); that finds several steps in one fit and weighs each by its size, at the price of a penalty
to tune. Ours needs no tuning and says how sure it is (p), at the price of testing one split at a time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from stack.benchrecord.significance import ALPHA, median_ratio, rank_test_p, within_min_effect


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
    groups = []
    for index, (commit, samples) in enumerate(series):
        if groups and groups[-1][0] == commit:
            groups[-1][2].extend(samples)
        else:
            groups.append((commit, index, list(samples)))
    return _between_neighbours(groups, _segment(groups))


def _segment(groups: list) -> list[Step]:
    best = _best_split(groups)
    if best is None:
        return []
    split, step = best
    return _segment(groups[:split]) + [step] + _segment(groups[split:])


def _between_neighbours(groups: list, steps: list[Step]) -> list[Step]:
    """Each step's ratio measured between the steps on either side of it (the level it left and the one it
    reached), rather than over the whole segment in which it was found."""
    starts = [index for index, (_, first, _) in enumerate(groups) if first in {step.index for step in steps}]
    bounds = [0, *starts, len(groups)]
    return [dataclasses.replace(step, ratio=median_ratio(_pooled(groups[bounds[i]:bounds[i + 1]]),
                                                         _pooled(groups[bounds[i + 1]:bounds[i + 2]])))
            for i, step in enumerate(steps)]


def _pooled(groups: list) -> list[float]:
    return [s for _, _, samples in groups for s in samples]


def _best_split(groups: list) -> tuple[int, Step] | None:
    """(group index, Step) of the most significant split of `groups`, or None when no split is significant."""
    boundaries = len(groups) - 1
    best = None
    for split in range(1, len(groups)):
        before, after = _pooled(groups[:split]), _pooled(groups[split:])
        ratio = median_ratio(before, after)
        if within_min_effect(ratio):
            continue
        exact = min(before) == max(before) and min(after) == max(after)  # two constant levels: certain
        p = 0.0 if exact else min(1.0, rank_test_p(before, after) * boundaries)
        if p < ALPHA and (best is None or p < best[1].p or (p == best[1].p and _size(ratio) > _size(best[1].ratio))):
            commit, index, _ = groups[split]
            best = (split, Step(index, commit, ratio, p))
    return best


def _size(ratio: float) -> float:
    return abs(math.log(ratio)) if 0 < ratio < math.inf else math.inf
