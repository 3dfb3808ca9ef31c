"""`stack bench instructions [--check | --update-baseline]`: instruction counts of the CPU kernels and the renderer.

Counts every stage of the fixed workloads (`stack.instructions.workloads`) under callgrind, prints them beside
the baseline of this ISA level (benchmarks/instructions/<level>.json) and the verdict (`baseline.judge`).
`--check` exits 1 on a regression or when this level has no baseline (what `make perf`, so `make test`,
runs); `--update-baseline` writes the counts as this level's baseline. The figures (unit "instructions" and
"misses", one sample each: they are exact) go into `--record` like any bench's.
"""

from __future__ import annotations

from stack.benchrecord import figures_of
from stack.instructions import baseline as bl
from stack.instructions.callgrind import Profile, run_workloads


def run(pipeline, args) -> int:
    """Measure, print the table and verdict; the exit code `--check` asks for."""
    from stack.benchrecord.machine import describe, hardware

    profile = run_workloads()
    level = profile.level["level"]
    path = bl.baseline_path(level)
    print(f"stack bench instructions: level {level} (the CPU valgrind presents: torch {profile.level['torch_capability']} "
          f"kernels, AVX-512 {'on' if profile.level['avx512'] else 'off'}); host {describe(hardware())}; one thread, "
          f"callgrind, simulated 32 KiB L1 / 8 MiB LL")
    record_figures(figures_of(args), profile)
    if getattr(args, "update_baseline", False):
        written = bl.write_json(path, bl.make_baseline(profile, hardware(), _commit(), bl.software()))
        print_table(profile, None)
        print(f"\nwrote the baseline of level {level}: {written}")
        return 0
    base = bl.read_baseline(path)
    print_table(profile, base)
    if base is None:
        return _no_baseline(profile, path, args)
    verdict = bl.judge(profile, base, bl.software(), totals_judged=bl.same_cpu(hardware(), base))
    return _verdict(verdict, path, bool(getattr(args, "check", False)))


def _no_baseline(profile: Profile, path, args) -> int:
    from stack.benchrecord.machine import hardware

    candidate = bl.write_json(bl.baseline_path(profile.level["level"], bl.CANDIDATE_DIR),
                              bl.make_baseline(profile, hardware(), _commit(), bl.software()))
    print(f"\nno baseline for level {profile.level['level']} ({path}): measured, not judged. The counts are in "
          f"{candidate}; review them and record the baseline with `stack bench instructions --update-baseline`.")
    return 1 if getattr(args, "check", False) else 0


def _verdict(verdict: bl.Verdict, path, check: bool) -> int:
    for note in verdict.notes:
        print(f"note: {note}")
    if verdict.regressions:
        print(f"\nREGRESSION against {path} (more than +{bl.THRESHOLD:.0%}):")
        for line in verdict.regressions:
            print(f"  {line}")
        return 1 if check else 0
    print(f"\npass: no stage's instructions or kernel function above +{bl.THRESHOLD:.0%}, no D1 / LL miss count "
          f"above +{bl.MISS_THRESHOLD:.0%} / +{bl.LL_MISS_THRESHOLD:.0%} of {path}")
    return 0


def print_table(profile: Profile, base: dict | None) -> None:
    names = list(bl.FIGURES)
    print("\n| stage | " + " | ".join(f"{n} | baseline | change" for n in names) + " |")
    print("|---|" + "---:|---:|---:|" * len(names))
    for stage in sorted(profile.stages):
        now, before = bl.figures(profile, stage), (base or {}).get("stages", {}).get(stage, {})
        cells = []
        for name in names:
            change = bl.growth(int(before.get(name, 0)), now[name])
            cells += [f"{now[name]:,}", f"{before[name]:,}" if name in before else "-",
                      "-" if change is None else f"{change:+.2%}"]
        print(f"| {stage} | " + " | ".join(cells) + " |")


def record_figures(log, profile: Profile) -> None:
    for stage in sorted(profile.stages):
        for name, value in bl.figures(profile, stage).items():
            log.add(f"{stage}: {name}", [value], "instructions" if name == "instructions" else "misses")


def _commit() -> str:
    from stack.lineage import git_commit

    sha, dirty = git_commit()
    return sha + ("+" if dirty == "true" else "")
