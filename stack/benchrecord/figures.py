"""The figures one `stack bench` run reports, each with the samples it was computed from.

A bench prints its tables (for a dated docs/log entry, then the docs/results table it updates); beside each
number it prints, it adds the figure to the run's `FigureLog`: a name, every individual measurement behind it
(the per-run times of a best-of-N or a median), the unit, which way is better, and the floor the bench judges
it against where it has one (bytes over bandwidth, FLOPs over peak). `stack bench NAME --record` writes the log
into a JSON record (`stack.benchrecord.records`).

Keeping the samples and not only the summary is what lets `stack bench compare` tell a change from
noise with a rank test, as asv (`asv/statistics.py`, Mann-Whitney U on the raw samples) and
pytest-benchmark (`--benchmark-compare` over stored rounds) do.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterable

MAX_SAMPLES = 10_000
"""Most samples a figure keeps, and a record may hold on read. The benches write at most a few hundred: the ops
bench keeps every run of half a second of timing (~330 for a 1.5 ms op on two cores), the CUDA benches 50 events, the
others 1 to 6 rounds; a microsecond-scale op on a fast CPU could time more, and `FigureLog.add` keeps evenly spaced
ones. Each sample costs the bootstrap `significance.BOOTSTRAP_RESAMPLES` draws."""


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure and its samples."""

    name: str
    """Unique within a bench run; a figure is followed across records by this name."""
    samples: tuple[float, ...]
    """The individual measurements, in the order they were taken."""
    unit: str
    """"s", "ms", "samples/s", "MiB", ... as the samples are stored."""
    lower_is_better: bool = True
    """True for times and sizes, False for rates."""
    floor: float | None = None
    """The bound the bench sets the figure against, in `unit` (for a rate, the best rate possible); None
    where the bench has none."""

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"figure {self.name!r} has no samples")
        bad = [s for s in self.samples if not isinstance(s, (int, float)) or not math.isfinite(s)]
        if bad:
            raise ValueError(f"figure {self.name!r} has samples that are not finite numbers: {bad[:3]!r}")
        if self.floor is not None and not math.isfinite(self.floor):
            raise ValueError(f"figure {self.name!r} has a floor that is not a finite number: {self.floor!r}")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def constant(self) -> bool:
        """Every sample is the same: an exact quantity (bytes, a prediction), not a noisy measurement."""
        return min(self.samples) == max(self.samples)


class FigureLog:
    """The figures of one bench run, in the order they were added."""

    def __init__(self) -> None:
        self._figures: dict[str, Figure] = {}

    def add(self, name: str, samples: Iterable[float], unit: str, *, lower_is_better: bool = True,
            floor: float | None = None) -> None:
        """Add a figure; a name used twice is a bench bug (the second would hide the first in every record). A
        time-bounded bench on a fast CPU may time more runs than a record holds: evenly spaced ones are kept."""
        if name in self._figures:
            raise ValueError(f"figure {name!r} was added twice in one bench run")
        values = [float(s) for s in samples]
        if len(values) > MAX_SAMPLES:
            values = [values[i * len(values) // MAX_SAMPLES] for i in range(MAX_SAMPLES)]
        self._figures[name] = Figure(name, tuple(values), unit, lower_is_better,
                                     None if floor is None else float(floor))

    @property
    def figures(self) -> list[Figure]:
        return list(self._figures.values())


def figures_of(args) -> FigureLog:
    """The log `stack bench` hands a bench on `args.figures`; a fresh one, read by nobody, when a bench
    function is called directly (tests)."""
    log = getattr(args, "figures", None)
    return log if log is not None else FigureLog()
