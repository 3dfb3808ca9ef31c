"""Bench records: figures with their samples, kept over commits, compared with their noise in mind.

- `figures`: `FigureLog`, what a bench adds each printed figure to (samples, unit, floor, direction);
- `machine`: the fingerprint that decides which records may be compared;
- `records`: the JSON record `stack bench NAME --record` writes, and the history folder of them;
- `significance`: faster / slower / same per figure (Mann-Whitney U, a minimum effect, a bootstrap interval);
- `steps`: the commit where a figure changed, over a history;
- `trends`: a PNG per figure over the commits;
- `comparison`: `stack bench compare`, which composes them.

Importing this package loads neither numpy, scipy nor matplotlib: the benches import `FigureLog` from it,
and `stack config` imports the CLI that names the default history folder.
"""

from stack.benchrecord.figures import Figure, FigureLog, figures_of

__all__ = ["Figure", "FigureLog", "figures_of"]
