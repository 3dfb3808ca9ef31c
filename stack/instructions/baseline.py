"""Baselines of instruction counts kept in the repository, one per ISA level, and the verdict against them.

The rule (docs/benchmarks.md, "Instruction-count regression check"; the figures below are measured in
docs/results/benchmarks.md, "The instruction-count check"):

- a stage's total instructions more than `THRESHOLD` (3%) above the baseline fail, and so do its simulated
  first-level cache misses more than `MISS_THRESHOLD` (20%) above and last-level ones more than
  `LL_MISS_THRESHOLD` (50%) (where an allocation lands moves them: D1 by 1.3%, LL by up to +21.8% between two
  working folders, docs/log/2026-12-02_ll-misses-by-folder.md; a layout that stops fitting the cache multiplies
  them); the message names
  the function whose own instructions grew most. So does any function of the project's
  own kernels (stack._C) that held at least `JUDGED_SHARE` (1%) of its stage and now executes 3% more (a
  kernel that slows down inside a stage dominated by other code still fails). Library functions (torch, numpy,
  CPython, libc) are judged through their stage's total: the allocator's share moves with the heap's state
  (another working folder, another environment), the totals by +0.26% at most;
- stage totals are library code as much as ours, and numpy's OpenBLAS and torch's MKL / oneDNN pick their
  kernels by the CPU's vendor and model (under valgrind too: it masks AVX-512, not the CPU's identity), so the
  totals are judged only on the kind of CPU the baseline was recorded on (same model name and ISA flags,
  `same_cpu`); elsewhere they are shown as notes and only the project's own kernel functions are judged
  (under valgrind they run their AVX2 clones on every host, so their counts do not depend on it);
- counts under `MIN_JUDGED` events are shown, not judged (a few hundred misses move by more than 3% when an
  allocation lands elsewhere);
- a level with no baseline file fails the check: the counts are written beside it for a person to review and
  commit (`stack bench instructions --update-baseline`); a passing check on a level nobody recorded would
  pass forever without having judged anything;
- the software that shapes the counts (the compiler that built stack._C, torch, numpy, python, valgrind) is
  recorded with the baseline; a difference is named in the report and in every failure, but the counts are
  still judged: a toolchain upgrade that costs 5% is worth a look, and re-recording is one command.

Counts repeat exactly on one machine (ten runs on a loaded machine, zero spread), so 3% leaves
room for nothing but real change; it is the smallest effect worth a failed build, as CodSpeed's default
regression threshold is (docs.codspeed.io, "Performance checks").
"""

from __future__ import annotations

import dataclasses
import json
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

from stack.instructions.callgrind import EVENTS, Profile

FORMAT = "stack-instruction-baseline"
BASELINE_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "instructions"
"""benchmarks/instructions/<level>.json in the repository."""
CANDIDATE_DIR = Path("runs") / "instructions"
"""Where a run on a level with no baseline leaves its counts (git ignores runs/)."""
THRESHOLD = 0.03
MISS_THRESHOLD = 0.20
LL_MISS_THRESHOLD = 0.50
JUDGED_SHARE = 0.01
STORED_SHARE = 0.002
"""Functions kept in a baseline: at least this share of their stage (smaller ones only add noise to the file)."""
MIN_JUDGED = 10_000
PROJECT_OBJECT = re.compile(r"\[_C\.[^\]]*\.so\]$")
"""Functions of the project's compiled kernels (stack._C), as `callgrind.read_dump` names them."""
FIGURES = {"instructions": ("Ir",), "D1 misses": ("D1mr", "D1mw"), "LL misses": ("DLmr", "DLmw")}
"""A stage's figures: name -> the callgrind events summed into it."""
LIMITS = {"instructions": THRESHOLD, "D1 misses": MISS_THRESHOLD, "LL misses": LL_MISS_THRESHOLD}
"""The growth each figure may show before the check fails."""


def figures(profile: Profile, stage: str) -> dict[str, int]:
    """{"instructions": n, "D1 misses": n, "LL misses": n} of one stage."""
    return {name: sum(profile.total(stage, event) for event in events) for name, events in FIGURES.items()}


def software() -> dict:
    """The versions that change the instructions a workload executes."""
    import torch  # noqa: F401  (stack._C links against its libraries)

    import stack._C as extension

    versions = {"python": platform.python_version()}
    for name in ("torch", "numpy"):
        versions[name] = metadata.version(name)
    versions["compiler"] = ", ".join(compilers_of(Path(extension.__file__))) or "unknown"
    done = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    versions["valgrind"] = done.stdout.strip()
    return versions


def compilers_of(library: Path) -> list[str]:
    """The compilers named in a shared library's .comment section ('GCC: (Debian 12.2.0-14) 12.2.0')."""
    found = re.findall(rb"GCC: \([^)\x00]*\) [0-9][0-9.]*", library.read_bytes())
    return sorted({name.decode() for name in found})


def make_baseline(profile: Profile, host: dict, commit: str, versions: dict) -> dict:
    """The JSON a baseline file holds: per stage its figures and its functions above `STORED_SHARE`."""
    stages = {}
    for stage in sorted(profile.stages):
        total = profile.total(stage)
        functions = {name: costs[EVENTS.index("Ir")] for name, costs in profile.stages[stage].items()
                     if costs[0] >= STORED_SHARE * total}
        stages[stage] = {**figures(profile, stage), "functions": dict(sorted(functions.items(), key=lambda kv: -kv[1]))}
    return {"format": FORMAT, "version": 1, "level": profile.level["level"], "dispatch": profile.level,
            "recorded_on": host, "commit": commit, "software": versions, "stages": stages}


def baseline_path(level: str, folder: Path | None = None) -> Path:
    return (BASELINE_DIR if folder is None else folder) / f"{level}.json"


def read_baseline(path: Path) -> dict | None:
    """The baseline at `path`, None when there is none; a ValueError when the file is not one."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT or not isinstance(data.get("stages"), dict):
        raise ValueError(f"{path} is not an instruction-count baseline (format {data.get('format')!r})")
    return data


def write_json(path: Path, data: dict) -> Path:
    from stack.durable import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


# ----------------------------------------------------------------------------- the verdict


@dataclasses.dataclass
class Verdict:
    regressions: list[str]
    """One line per figure or function over the threshold (empty: the check passes)."""
    notes: list[str]
    """Improvements, new or vanished stages, software differences: said, not failed."""


def same_cpu(host: dict, baseline: dict) -> bool:
    """Whether `host` (`benchrecord.machine.hardware()`) is the kind of CPU the baseline was recorded on."""
    recorded = baseline.get("recorded_on") or {}
    return host.get("cpu") == recorded.get("cpu") and list(host.get("isa") or []) == list(recorded.get("isa") or [])


def judge(profile: Profile, baseline: dict, versions: dict, totals_judged: bool = True) -> Verdict:
    """Every stage's figures and the project's large functions against the baseline (the rule in the module
    docstring); `versions`: this run's `software()`; `totals_judged`: False on another kind of CPU than the
    baseline's (`same_cpu`), where only the project's kernel functions are judged."""
    regressions, notes = [], []
    if not totals_judged:
        notes.append("another kind of CPU than the baseline's: stage totals (library kernels chosen by the CPU) are "
                     "shown, not judged; the project's kernel functions are judged")
    for stage in sorted(set(profile.stages) | set(baseline["stages"])):
        if stage not in profile.stages:
            notes.append(f"{stage}: in the baseline, not measured any more")
        elif stage not in baseline["stages"]:
            notes.append(f"{stage}: new stage, not in the baseline (record it with --update-baseline)")
        else:
            judge_stage(stage, profile, baseline["stages"][stage], regressions if totals_judged else notes, notes,
                        regressions)
    differences = software_differences(baseline.get("software", {}), versions)
    if differences:
        notes.append("software differs from the baseline's: " + "; ".join(differences))
        if regressions:
            regressions.append("the software differs from the baseline's (above): if that explains the growth, "
                               "record the baseline again with `stack bench instructions --update-baseline`")
    return Verdict(regressions, notes)


def judge_stage(stage: str, profile: Profile, base: dict, regressions: list[str], notes: list[str],
                kernel_regressions: list[str] | None = None) -> None:
    """Stage totals into `regressions` (or notes), kernel functions into `kernel_regressions` (default: the same)."""
    kernel_regressions = regressions if kernel_regressions is None else kernel_regressions
    now = figures(profile, stage)
    for name, value in now.items():
        before, limit = int(base.get(name, 0)), LIMITS[name]
        change = growth(before, value)
        if before < MIN_JUDGED or change is None:
            continue
        if change > limit:
            regressions.append(f"{stage}: {name} {before:,} -> {value:,} ({change:+.1%}, limit +{limit:.0%}); "
                               f"grew most: {grew_most(profile.stages[stage], base['functions'])}")
        elif change < -limit:
            notes.append(f"{stage}: {name} {before:,} -> {value:,} ({change:+.1%}): faster; lock it in with "
                         f"--update-baseline")
    for function, before in base["functions"].items():
        after = profile.stages[stage].get(function, [0])[0]
        change = growth(before, after)
        judged = PROJECT_OBJECT.search(function) and before >= JUDGED_SHARE * base["instructions"]
        if judged and change is not None and change > THRESHOLD:
            kernel_regressions.append(f"{stage}: function {function}: {before:,} -> {after:,} instructions ({change:+.1%}, "
                               f"limit +{THRESHOLD:.0%})")


def growth(before: int, after: int) -> float | None:
    return None if before <= 0 else after / before - 1


def grew_most(functions: dict[str, list[int]], base_functions: dict[str, int]) -> str:
    """'NAME +n instructions (+x%)' for the function whose own instructions grew the most in number."""
    deltas = {name: functions.get(name, [0])[0] - base_functions.get(name, 0)
              for name in set(functions) | set(base_functions)}
    name = max(deltas, key=lambda n: deltas[n])
    before = base_functions.get(name)
    share = f" ({growth(before, before + deltas[name]):+.1%})" if before else " (new, or under the stored share before)"
    return f"{name} {deltas[name]:+,} instructions{share}"


def software_differences(recorded: dict, current: dict) -> list[str]:
    return [f"{key} {recorded.get(key)!r} then, {current.get(key)!r} now"
            for key in sorted(set(recorded) | set(current)) if recorded.get(key) != current.get(key)]
