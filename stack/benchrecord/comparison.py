"""`stack bench compare`: two records, or a record against the history, figure by figure.

    stack bench compare BASELINE.json CANDIDATE.json      # two records
    stack bench compare CANDIDATE.json --history [DIR]    # against the newest earlier record of the same bench
    stack bench compare --history [DIR]                   # the newest record in DIR against the one before

A figure is compared only between records from the same machine (`stack.benchrecord.machine`); on another
machine every figure is listed "not comparable: different machine" with what differs. With a history,
the baseline is the newest earlier record of the same bench, with the same arguments, on the same
machine; the steps over all such records are named (`stack.benchrecord.steps`) and each figure's trend
is drawn into `DIR/trends/<bench>/` (`stack.benchrecord.trends`).

Exit 0: no figure got slower (or worse); 1: at least one did, so CI can fail on it; 2: bad input (a
missing or corrupt record, an empty history, records of different benches).

Why not the other two comparisons' statistics: a figure's samples in two runs are unpaired (no sample of one
run belongs with one of the other) and skewed by other load, so the test is a rank test on the ratio of medians
(`stack.benchrecord.significance`), not `stack drive --compare`'s paired bootstrap of a mean gain over episodes.
`stack runs compare` has one value per metric per run and so no test at all.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stack.benchrecord.figures import Figure
from stack.benchrecord.machine import describe, hardware_differences
from stack.benchrecord.load import LOADED_OTHER_CPU
from stack.benchrecord.records import Record, in_commit_order, load_history, read_record
from stack.benchrecord.significance import ALPHA, MIN_EFFECT, Verdict, compare_figures
from stack.errors import StackError
from stack.safe_values import escaped

MAX_LINE = 100_000
"""Longest line printed (a table row holds a figure's name; the notes hold the arguments)."""
USAGE = ("give two records (stack bench compare BASELINE.json CANDIDATE.json), or one record or none with "
         "--history [DIR] (stack bench compare CANDIDATE.json --history runs/bench-history)")
DIFFERENT_MACHINE = "not comparable: different machine"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    baseline: Figure | None
    candidate: Figure | None
    verdict: Verdict | None
    """None when the figure is not compared (see `note`)."""
    note: str = ""


def compare_records(baseline: Record, candidate: Record) -> list[Row]:
    """One row per figure of either record: a verdict where both hold it and the machines are the same."""
    different_machine = bool(hardware_differences(baseline.hardware, candidate.hardware))
    names = list(candidate.figures) + [name for name in baseline.figures if name not in candidate.figures]
    rows = []
    for name in names:
        old, new = baseline.figures.get(name), candidate.figures.get(name)
        if old is None or new is None:
            rows.append(Row(name, old, new, None, "only in the candidate" if old is None else "only in the baseline"))
        elif different_machine:
            rows.append(Row(name, old, new, None, DIFFERENT_MACHINE))
        else:
            rows.append(Row(name, old, new, compare_figures(old, new)))
    return rows


def regressions(rows: list[Row]) -> list[Row]:
    return [row for row in rows if row.verdict is not None and row.verdict.regression]


# ---------------------------------------------------------------------------------------- text


def header(baseline: Record, candidate: Record) -> list[str]:
    """Which records, which machine, and everything else that differs between them."""
    lines = [f"stack bench compare: {candidate.bench}",
             f"baseline:  {_describe_record(baseline)}", f"candidate: {_describe_record(candidate)}"]
    differences = hardware_differences(baseline.hardware, candidate.hardware)
    if differences:
        lines.append(f"{DIFFERENT_MACHINE}: " + "; ".join(differences) + " (figures are compared only on one machine)")
    else:
        lines.append(f"machine: {describe(candidate.hardware)}")
    lines += [f"note: {note}" for note in _notes(baseline, candidate)]
    lines.append(f"method: Mann-Whitney U (two-sided) on each figure's samples at alpha = {ALPHA:g}; a median change "
                 f"under {MIN_EFFECT:.0%} is 'same'; ratio = candidate median / baseline median with its "
                 f"{1 - ALPHA:.0%} bootstrap interval")
    return lines


def _describe_record(record: Record) -> str:
    pipeline = f"pipeline {record.pipeline.get('name')} {record.pipeline.get('hash')}"
    load = "" if record.other_cpu is None else f", other work {record.other_cpu:.0%} of the CPU time"
    return f"{record.source or '(new)'}: commit {record.label}, {record.recorded_at}{load}, {pipeline}"


def _notes(baseline: Record, candidate: Record) -> list[str]:
    notes = []
    if baseline.pipeline.get("hash") != candidate.pipeline.get("hash"):
        notes.append("the pipeline hashes differ: the figures may measure different work")
    if baseline.arguments != candidate.arguments:
        notes.append(f"the arguments differ: {baseline.arguments} vs {candidate.arguments}")
    old, new = baseline.machine.get("software", {}), candidate.machine.get("software", {})
    changed = [f"{name} {old.get(name)} -> {new.get(name)}" for name in sorted(set(old) | set(new))
               if old.get(name) != new.get(name)]
    if changed:
        notes.append("software differs: " + ", ".join(changed))
    notes += [f"{which} ran on a loaded machine (other work took {record.other_cpu:.0%} of its CPU time while it "
              f"measured): its samples moved together; a verdict says these runs differ, not yet that the code does"
              for which, record in (("the baseline", baseline), ("the candidate", candidate)) if record.loaded()]
    notes += [f"{which} bench exited {record.exit_code} (a missed goal or a failure)"
              for which, record in (("the baseline", baseline), ("the candidate", candidate)) if record.exit_code]
    return notes


def table(rows: list[Row]) -> list[str]:
    lines = ["| figure | unit | baseline median | candidate median | ratio [interval] | p | floor | verdict |",
             "|---|---|---:|---:|---|---:|---:|---|"]
    for row in rows:
        figure = row.candidate or row.baseline
        cells = [row.name, figure.unit, _number(row.baseline), _number(row.candidate)]
        if row.verdict is None:
            cells += ["-", "-", _floor(figure), row.note]
        else:
            verdict = row.verdict
            low, high = verdict.interval
            p = "-" if verdict.p is None else f"{verdict.p:.2g}"
            cells += [f"{verdict.ratio:.3f} [{low:.3f}, {high:.3f}]", p, _floor(figure), f"{verdict.word}: {verdict.why}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _number(figure: Figure | None) -> str:
    return "-" if figure is None else f"{figure.median:.4g} (n={len(figure.samples)})"


def _floor(figure: Figure) -> str:
    return "-" if figure.floor is None else f"{figure.floor:.4g}"


def summary(rows: list[Row]) -> str:
    worse = regressions(rows)
    if not worse:
        return "no regression"
    return f"{len(worse)} regression{'s' if len(worse) > 1 else ''}: " + ", ".join(row.name for row in worse)


# ---------------------------------------------------------------------------------------- history


def same_series(history: list[Record], candidate: Record) -> list[Record]:
    """The records a candidate is judged against, in the history's order, ending with the candidate itself: the
    same bench with the same arguments, before the candidate in that order (a candidate from outside the history:
    recorded no later than it)."""
    own = Path(candidate.source).resolve() if candidate.source else None
    sources = [Path(record.source).resolve() if record.source else None for record in history]
    before = history[:sources.index(own)] if own is not None and own in sources else \
        [record for record in history if record.recorded_at <= candidate.recorded_at]
    earlier = [record for record in before
               if record.bench == candidate.bench and record.arguments == candidate.arguments
               and (own is None or Path(record.source).resolve() != own)]
    return earlier + [candidate]


def pick_baseline(series: list[Record]) -> Record | None:
    """The newest earlier record on the candidate's machine; else the newest from another machine (whose
    figures are then listed as not comparable); None for a first record."""
    candidate, earlier = series[-1], series[:-1]
    same_machine = [record for record in earlier if record.hardware == candidate.hardware]
    return (same_machine or earlier or [None])[-1]


def history_report(series: list[Record], trends: Path) -> list[str]:
    """Steps over the candidate machine's records of each figure, and a trend PNG per figure into `trends`."""
    from stack.benchrecord.steps import find_steps, unresolvable
    from stack.benchrecord.trends import plot_trend, trend_path
    from stack.benchrecord.significance import change_word

    candidate = series[-1]
    same_machine = [record for record in series if record.hardware == candidate.hardware]
    mine = [record for record in same_machine if not record.loaded()]
    loaded = len(same_machine) - len(mine)
    lines, plots, unwritten = [], 0, ""
    for name, figure in candidate.figures.items():
        holding = [record for record in mine if name in record.figures]
        points = [(record.commit, record.figures[name].samples) for record in holding]
        steps, why_not = find_steps(points), unresolvable(points)
        lines += [f"- {name}: {why_not}"] if why_not else []
        lines += [f"- {name}: {change_word(figure.unit, figure.lower_is_better, step.ratio)} {step.ratio:.3f}x at commit "
                  f"{holding[step.index].label} ({holding[step.index].recorded_at}, p = {step.p:.2g})" for step in steps]
        if holding and not unwritten:
            try:
                plot_trend(name, holding, steps, trend_path(trends, name))
                plots += 1
            except OSError as exc:  # a read-only history, a file named trends: the verdicts stand without plots
                unwritten = (f"; could not write the rest ({exc.strerror or exc}: {exc.filename}): make the folder "
                             f"writable, or move away what is in the way")
    others = len(series) - len(same_machine)
    return ([f"steps over {len(mine)} records on this machine (circular binary segmentation: a rank test of each run "
             f"of commits against the rest, over the records' medians, the run being the unit; Bonferroni-corrected, "
             f"alpha = {ALPHA:g}; "
             f"{others} records from other machines left out; {loaded} loaded records set aside, during which "
             f"other work took {LOADED_OTHER_CPU:.0%} of the CPU time or more):"]
            + (lines or ["- none"]) + [f"trend plots: {plots} PNGs in {trends}{unwritten}"])


# ---------------------------------------------------------------------------------------- command


def run_compare(paths: list[str], history: str | None) -> int:
    """`stack bench compare`; prints the report and returns the exit code (StackError for bad input)."""
    if history is None:
        if len(paths) != 2:
            raise StackError(f"stack bench compare: found {len(paths)} record paths; {USAGE}")
        baseline, candidate = (read_record(Path(path)) for path in paths)
        _check_same_bench(baseline, candidate)
        return _report(baseline, candidate, [])
    if len(paths) > 1:
        raise StackError(f"stack bench compare --history takes one record or none, found {len(paths)}; {USAGE}")
    folder = Path(history)
    past, order = in_commit_order(load_history(folder))
    candidate = read_record(Path(paths[0])) if paths else past[-1]
    series = same_series(past, candidate)
    baseline = pick_baseline(series)
    extra = [order, *history_report(series, folder / "trends" / candidate.bench)]
    if baseline is None:
        say([f"stack bench compare: {candidate.bench}: no earlier record with the same arguments in {folder}: "
             f"nothing to compare against yet ({candidate.source})", *extra])
        return 0
    return _report(baseline, candidate, extra)


def say(lines: list[str]) -> None:
    """Print the report, each line escaped: figure names, units, commits, the machine's and the pipeline's names come
    from the records, i.e. from whoever wrote them, and an escape sequence printed raw rewrites the terminal."""
    print("\n".join(escaped(line, MAX_LINE) for line in lines))


def _check_same_bench(baseline: Record, candidate: Record) -> None:
    if baseline.bench != candidate.bench:
        raise StackError(f"the records are of different benches: {escaped(baseline.source)} is `stack bench "
                         f"{baseline.bench}`, {escaped(candidate.source)} is `stack bench {candidate.bench}`; compare "
                         f"two records of one bench")


def _report(baseline: Record, candidate: Record, extra: list[str]) -> int:
    rows = compare_records(baseline, candidate)
    say(header(baseline, candidate) + [""] + table(rows) + [""] + extra + [summary(rows)])
    return 1 if regressions(rows) else 0
