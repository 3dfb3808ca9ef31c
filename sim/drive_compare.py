"""`stack drive --compare BEFORE AFTER`: did a change help, episode by episode?

`stack drive` judges the policies it drove side by side; a change that is not a policy of its own (a plan-guard
setting, a drive-time rule, a simulator fix) is judged by driving twice on the same episodes and comparing the two
reports. Two means with their own intervals hide what pairing shows: the episodes differ far more from each other
than the two settings do (on tiny-drive the per-episode driving score spreads ~0.3, a setting moves it ~0.01), so
the gain is bootstrapped over the per-episode differences (`stack.metrics.driving.paired_gain`, whole episodes
resampled), as the closed-loop bar does against the blind policies.

Policies are paired by name (the same checkpoint driven twice keeps its name); when the two drives share no
network policy's name and each has exactly one, those two are paired. Baselines that both drove are compared too:
on the same episodes they must not move, which checks that the worlds were the same.

Why not the other two comparisons' statistics: here the two sides are paired (the same episode driven twice), so
the per-episode difference is the unit and its mean with a bootstrap interval is the test, the one the closed-loop
bar uses. `stack bench compare` has unpaired, skewed timing samples (a rank test on medians) and `stack runs
compare` one value per metric per run (no test at all), so neither can pair.
"""

from __future__ import annotations

import math
from pathlib import Path

from stack.errors import StackError
from stack.metrics.driving import episode_key, paired_gain
from stack.sim.policies import BASELINE_KINDS
from stack.user_json import read_json

COMPARED = ("driving_score", "pdms", "route_completion", "collisions")
"""What the comparison reports: the two headline scores, and the progress and the at-fault collisions per episode
they are made of (a rule that trades one for the other shows there)."""
SAME_WORLDS = ("split", "episode_seconds", "sim_hz", "replan_hz")
"""Settings of `drive` that change the worlds an episode key (family, seed, index) names: two drives that differ in
one of them did not drive the same episodes."""


def read_drive(path: str | Path) -> dict:
    """The report `stack drive` wrote (a drive folder or its drive.json), checked for what a comparison reads."""
    path = Path(path)
    file = path / "drive.json" if path.is_dir() else path
    if not file.is_file():
        raise StackError(f"--compare {path}: expected a stack drive folder or its drive.json (stack drive writes them "
                         f"to drive.out_dir); found {'a folder without drive.json' if path.is_dir() else 'nothing'}")
    report = read_json(file, "the JSON report stack drive writes (--compare)", "Drive again to rewrite it.")
    rows = report.get("rows")
    if not isinstance(rows, list) or not rows or not all(_is_row(row) for row in rows):
        raise StackError(f"--compare {file}: expected stack drive's report (a 'rows' list of episodes with policy, "
                         f"family, seed and metrics); this file has none: is it another tool's JSON?")
    return {"file": file, "rows": rows, "meta": report.get("meta") if isinstance(report.get("meta"), dict) else {}}


def _is_row(row) -> bool:
    return (isinstance(row, dict) and isinstance(row.get("policy"), str) and isinstance(row.get("family"), str)
            and isinstance(row.get("seed"), int) and isinstance(row.get("metrics"), dict))


def pairs(before: dict, after: dict) -> list[tuple[str, str]]:
    """(policy in before, policy in after) to compare: the names both drove, or their one network policy each."""
    names = [list(dict.fromkeys(row["policy"] for row in report["rows"])) for report in (before, after)]
    shared = [name for name in names[0] if name in names[1]]
    networks = [[name for name in found if name not in BASELINE_KINDS] for found in names]
    if any(name not in BASELINE_KINDS for name in shared) or (not any(networks) and shared):
        return [(name, name) for name in shared]
    if len(networks[0]) == 1 and len(networks[1]) == 1:
        return [(networks[0][0], networks[1][0])] + [(name, name) for name in shared]
    raise StackError(f"--compare: the two drives share no network policy ({', '.join(networks[0]) or 'none'} against "
                     f"{', '.join(networks[1]) or 'none'}) and do not have one network each to pair; compare drives of "
                     f"the same checkpoint or bundle")


def check_same_worlds(before: dict, after: dict) -> None:
    """Refuse two drives whose episode keys name different worlds (another split, episode length or rate)."""
    differing = [f"drive.{key} {before['meta'][key]!r} against {after['meta'][key]!r}" for key in SAME_WORLDS
                 if key in before["meta"] and key in after["meta"] and before["meta"][key] != after["meta"][key]]
    if differing:
        raise StackError(f"--compare: the two drives did not drive the same worlds ({'; '.join(differing)}); "
                         f"drive the change again with the other drive's settings")


def compare_drives(before: dict, after: dict, metrics=COMPARED) -> list[dict]:
    """One `paired_gain` per compared policy pair and metric, after minus before, with both means."""
    check_same_worlds(before, after)
    out = []
    for old, new in pairs(before, after):
        mine = {episode_key(row): row for row in before["rows"] if row["policy"] == old}
        theirs = {episode_key(row): row for row in after["rows"] if row["policy"] == new}
        shared = [key for key in mine if key in theirs]
        if not shared:
            raise StackError(f"--compare: {old!r} and {new!r} drove no episode in common (episode keys family, seed, "
                             f"index); compare drives of the same drive.episodes and drive.seeds")
        for metric in metrics:
            both = [key for key in shared if _finite(mine[key]["metrics"].get(metric))
                    and _finite(theirs[key]["metrics"].get(metric))]
            if not both:
                continue
            rows = [{**mine[key], "policy": "before"} for key in both] + [{**theirs[key], "policy": "after"} for key in both]
            gain = paired_gain(rows, "after", "before", metric)
            out.append({**gain, "policy": old if old == new else f"{old} -> {new}", "metric": metric,
                        "before": _mean(mine, both, metric), "after": _mean(theirs, both, metric)})
    return out


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _mean(rows: dict, keys: list, metric: str) -> float:
    """The mean of `metric` over the episodes `keys`: the same episodes the paired gain is over."""
    return sum(float(rows[key]["metrics"][metric]) for key in keys) / len(keys)


def compare_markdown(before: dict, after: dict, gains: list[dict]) -> str:
    """The comparison as a markdown table, with the two reports named and how to read the interval."""
    lines = ["# Paired comparison of two drives", "",
             f"- before: `{before['file']}`", f"- after: `{after['file']}`",
             "- gain = after - before on the episodes both drove; 90% paired bootstrap interval over episodes "
             "(whole episodes resampled); **bold** where the interval excludes zero", "",
             "| policy | metric | before | after | gain | 90% interval | episodes |",
             "|---|---|---:|---:|---:|---|---:|"]
    for gain in gains:
        excludes_zero = gain["low"] > 0 or gain["high"] < 0
        interval = f"[{gain['low']:+.3f}, {gain['high']:+.3f}]"
        lines.append(f"| `{gain['policy']}` | {gain['metric']} | {gain['before']:.3f} | {gain['after']:.3f} | "
                     f"{gain['gain']:+.3f} | {f'**{interval}**' if excludes_zero else interval} | "
                     f"{gain['episodes']} |")
    return "\n".join(lines) + "\n"
