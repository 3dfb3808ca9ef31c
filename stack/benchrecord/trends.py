"""Trend plots: one PNG per figure, its samples and median over the commits of a history.

Each record is one position on the x axis, labelled with its commit (`+` for uncommitted changes); its
samples are dots, the medians a line, the floor (where the bench has one) a dashed line, and every step
`stack.benchrecord.steps` found a vertical line before the commit it names. Only records from one machine
are drawn: timings from different machines on one axis would show steps that are not in the code. A PNG is
written whole or not at all (`records.write_whole`): a kill while it is drawn leaves the previous one.
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

from stack.benchrecord.records import Record, write_whole
from stack.benchrecord.steps import Step
from stack.benchrecord.significance import change_word


def trend_path(folder: Path, name: str) -> Path:
    """A file name readable as the figure's name and unique to it (names differ in characters a file cannot hold)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:80]
    return folder / f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.png"


def plot_trend(name: str, records: list[Record], steps: list[Step], path: Path) -> Path:
    """Draw figure `name` over `records` (oldest first, each holding it) into the PNG at `path`."""
    from matplotlib.figure import Figure as Canvas

    figures = [record.figures[name] for record in records]
    canvas = Canvas(figsize=(max(6.0, 0.5 * len(records) + 3), 4.0), layout="constrained")
    axes = canvas.add_subplot()
    for x, figure in enumerate(figures):
        axes.plot([x] * len(figure.samples), figure.samples, ".", color="tab:blue", alpha=0.5, markersize=4)
    axes.plot(range(len(figures)), [f.median for f in figures], "-o", color="tab:blue", label="median")
    floors = [f.floor for f in figures]
    if any(floor is not None for floor in floors):
        axes.plot(range(len(figures)), [float("nan") if f is None else f for f in floors], "--", color="tab:gray",
                  label="floor")
    for step in steps:
        axes.axvline(step.index - 0.5, color="tab:red", linestyle=":")
        axes.annotate(f"{change_word(figures[0].unit, figures[0].lower_is_better, step.ratio)} {step.ratio:.2f}x",
                      (step.index - 0.5, 1.0), xycoords=("data", "axes fraction"), color="tab:red",
                      ha="left", va="top", fontsize=8)
    axes.set_xticks(range(len(records)), [record.label for record in records], rotation=45, ha="right", fontsize=7)
    better = "lower" if figures[-1].lower_is_better else "higher"
    axes.set_ylabel(f"{figures[-1].unit} ({better} is better)")
    axes.set_title(f"{records[-1].bench}: {name}", fontsize=9)
    axes.legend(fontsize=7)
    png = io.BytesIO()
    canvas.savefig(png, dpi=100, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_whole(path, png.getvalue(), "trend")
