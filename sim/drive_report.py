"""The closed-loop report: `drive.md` for people, `drive.json` for machines, `drive.png` for the eye.

It puts every policy side by side, per scenario family and overall,
each number the mean ± std over seeds (`stack.metrics.driving.aggregate`), so
that the trained or deployed network can be read against the privileged
expert above it and the camera-blind baselines below it. The metrics are
NAVSIM's PDM score terms (Dauner et al. 2024, arXiv:2406.15349) and CARLA's
driving score (leaderboard.carla.org); `stack.metrics.driving` defines them.

`meta` (all keys optional; what is absent is left out of the header; `stack.sim.drive.drive`
writes it):
    pipeline: str; sources: {policy: checkpoint or bundle path}; checkpoint, bundle: paths;
    scenarios (or families): list; episodes: int; seeds: list; episode_seconds (or duration_s), sim_hz, replan_hz;
    cpu: str; host_cores, workers: int; wall_seconds (or wall_s): float;
    latency: {policy: {"ms": float, "how": str ("measured on this host ...", "predicted ...", "given ...")}};
    policies: {policy: {"blind": bool (sees no camera), "privileged": bool (sees the world), "description": str}}
        (without it, BLIND_POLICIES / PRIVILEGED_POLICIES name the baselines);
    clips: {policy: [{"file": str, "index": int (optional), "driving_score": float}]} or a list of such dicts with
        "policy": each policy's episode clips, matched to rows by index, else by the "-ep{index:03d}." in the name;
        an entry's "kind" is "worst" (the default: the worst-episode table shows it) or "best" (the best episode of
        its family, drive.best_clips: the best-episode table shows it).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from stack.durable import write_atomic

COLUMNS = (
    ("driving_score", "driving score", True),
    ("pdms", "PDMS", True),
    ("route_completion", "route completion", True),
    ("collisions", "at-fault collisions / ep", False),
    ("collisions_vehicle", "vehicle", False),
    ("collisions_pedestrian", "pedestrian", False),
    ("collisions_cyclist", "cyclist", False),
    ("collisions_static", "static", False),
    ("drivable_area_compliance", "drivable area", True),
    ("ttc", "TTC", True),
    ("comfort", "comfort", True),
    ("ego_progress", "EP", True),
    ("min_speed_penalty", "min-speed penalty", True),
    ("ended_collision", "ended: crash", False),
    ("ended_blocked", "ended: blocked", False),
    ("ended_route_deviation", "ended: off route", False),
)
"""(metric key, column header, higher is better), in table order."""
OVERALL = "all"
"""The family key of `aggregate`'s over-all-families entry."""
WORST_PER_POLICY = 3
BLIND_POLICIES = ("constant_velocity", "ego_rollout")
"""Baselines that see no camera (stack.sim.policies), when meta does not say."""
PRIVILEGED_POLICIES = ("expert",)
"""Baselines that read the world itself: the upper bound, not a competitor."""


def write_report(out_dir, summary: dict, rows: list, meta: dict) -> list[Path]:
    """Write drive.md, drive.json and drive.png into `out_dir`; return their paths.

    `summary`: `stack.metrics.driving.aggregate` output, {policy: {family | "all": {metric: {mean, std, episodes}}}}.
    `rows`: per episode {"policy", "family", "seed", "index", "latency_ms", "metrics": {...}}. `meta`: see module doc.
    """
    if not summary or not rows:
        raise ValueError(f"write_report({out_dir}): nothing to report ({len(summary or {})} policies scored, "
                         f"{len(rows or [])} episode rows); drive at least one episode first")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [write_atomic(out / "drive.md", markdown(summary, rows, meta).encode()),
            write_atomic(out / "drive.json", drive_json(summary, rows, meta).encode()),
            plot_scores(out / "drive.png", summary, meta)]


def drive_json(summary: dict, rows: list, meta: dict) -> str:
    """Plain JSON of the whole evaluation: NaN and infinities become null, numpy values plain numbers."""
    return json.dumps(plain({"summary": summary, "rows": rows, "meta": meta}), indent=1, allow_nan=False) + "\n"


def plain(value):
    """`value` with only JSON types left: non-finite floats -> None, numpy scalars/arrays, tuples, paths converted."""
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if hasattr(value, "tolist"):  # numpy scalar or array
        return plain(value.tolist())
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"drive.json: cannot write a {type(value).__name__} ({value!r}) as JSON")


# ---------------------------------------------------------------------------------------------- markdown


def markdown(summary: dict, rows: list, meta: dict) -> str:
    """drive.md: header, the best against the blind, the overall table, one table per family, worst episodes."""
    policies = policy_order(summary)
    families = family_order(summary, meta)
    seeds = meta.get("seeds")
    if seeds is None:
        over = "mean ± std over seeds"
    elif len(seeds) == 1:
        over = "one seed: means, no spread to show"
    else:
        over = f"mean ± std over {len(seeds)} seeds"
    lines = ["# Closed-loop driving report", ""] + header_lines(rows, meta, policies) + [""]
    lines += bar_lines(meta) + interval_lines(rows, policies) + comparison_lines(summary, meta, policies, families)
    lines += [f"## Overall ({over}; every family)", ""] + table_lines(summary, policies, OVERALL, meta) + [""]
    lines += ["Columns: driving score = route completion × infraction penalties (CARLA leaderboard); PDMS = NC × DAC × "
              "weighted (EP, TTC, comfort) (NAVSIM); collisions are at-fault, per episode, by the class hit; EP = "
              "progress relative to the expert's on the same episode. Best value per column in bold; "
              "std is over the per-seed means.", ""]
    for family in families:
        lines += [f"## {family}", ""] + table_lines(summary, policies, family, meta) + [""]
    lines += worst_lines(rows, meta, policies) + best_lines(rows, meta, policies) + time_lines(rows, meta, policies)
    return "\n".join(lines)


def policy_order(summary: dict) -> list:
    """Policies by overall driving score, best first (ties and missing scores keep the summary's order)."""
    def score(name):
        value = _stat(summary, name, OVERALL, "driving_score")[0]
        return -value if value is not None else math.inf
    return sorted(summary, key=score)


def family_order(summary: dict, meta: dict) -> list:
    present = {family for per_family in summary.values() for family in per_family if family != OVERALL}
    ordered = [family for family in _first(meta, "scenarios", "families") or () if family in present]
    return ordered + sorted(present - set(ordered))


def _first(meta: dict, *keys):
    """The first of `keys` that meta has (the evaluator's name, then the documented alias)."""
    return next((meta[key] for key in keys if meta.get(key) is not None), None)


def _policy_meta(meta: dict, policy: str) -> dict:
    return (meta.get("policies") or {}).get(policy) or {}


def is_blind(meta: dict, policy: str) -> bool:
    return bool(_policy_meta(meta, policy).get("blind", policy in BLIND_POLICIES))


def is_privileged(meta: dict, policy: str) -> bool:
    return bool(_policy_meta(meta, policy).get("privileged", policy in PRIVILEGED_POLICIES))


def policy_label(meta: dict, policy: str) -> str:
    tags = [tag for tag, on in (("blind", is_blind(meta, policy)), ("privileged", is_privileged(meta, policy))) if on]
    return f"`{policy}`" + (f" ({', '.join(tags)})" if tags else "")


def header_lines(rows: list, meta: dict, policies: list) -> list:
    """What was driven, how often, at which rates, on what, and each policy's latency in the loop."""
    lines = [f"- Pipeline: {meta['pipeline']}"] if meta.get("pipeline") else []
    for key, label in (("checkpoint", "Checkpoint"), ("bundle", "Bundle")):
        if meta.get(key):
            lines.append(f"- {label}: `{meta[key]}`")
    lines += [f"- `{name}` drove `{path}`" for name, path in (meta.get("sources") or {}).items()]
    episodes = meta.get("episodes") or len({row.get("index") for row in rows}) or None
    seeds, seconds, families = meta.get("seeds"), _first(meta, "episode_seconds", "duration_s"), \
        _first(meta, "scenarios", "families")
    tuning = meta.get("split") == "tuning"
    kind = "tuning (not held-out: for choosing settings, not for reporting)" if tuning else "held-out"
    scenario = [f"{episodes} {kind} episodes per policy" if episodes else None,
                f"seeds {', '.join(str(s) for s in seeds)}" if seeds else None,
                f"{seconds:g} s each" if seconds else None]
    if any(scenario):
        lines.append("- Scenarios: " + ", ".join(p for p in scenario if p)
                     + (f"; families {', '.join(families)}" if families else ""))
    rates = [f"simulation {meta['sim_hz']:g} Hz" if meta.get("sim_hz") else None,
             f"cameras and replanning {meta['replan_hz']:g} Hz" if meta.get("replan_hz") else None]
    if any(rates):
        lines.append("- Rates: " + ", ".join(p for p in rates if p))
    wall = _first(meta, "wall_seconds", "wall_s")
    host = [meta.get("cpu"), f"{meta['host_cores']} cores" if meta.get("host_cores") else None,
            f"{meta['workers']} worker processes" if meta.get("workers") else None,
            f"{wall:.0f} s wall" if wall else None]
    if any(host):
        lines.append("- Host: " + ", ".join(str(p) for p in host if p))
    lines += post_processing_lines(meta, policies)
    lines += ["- Latency in the loop (a plan reaches the controller only this long after its camera frame):"]
    lines += [f"  - {policy_label(meta, policy)}: {latency_text(rows, meta, policy)}" for policy in policies]
    return lines


def post_processing_lines(meta: dict, policies: list) -> list[str]:
    """What each network policy drove with: its plan guard (a bundle's own, the checkpoint's pipeline's), or the
    network alone beside a guarded one (which part drives). Older reports recorded one guard for all."""
    per_policy = meta.get("post_processing")
    if not isinstance(per_policy, dict):
        guard = meta.get("plan_guard")
        networks = [p for p in policies if not (_policy_meta(meta, p).get("blind") or _policy_meta(meta, p).get("privileged"))]
        return [f"- Network policies drive {plan_guard_text(guard)}"] if isinstance(guard, dict) and networks else []
    alone = meta.get("alone_of") or {}
    lines = []
    for policy in policies:
        if isinstance(per_policy.get(policy), dict):
            beside = f" (the network alone of `{alone[policy]}`: information, no verdict)" if policy in alone else ""
            lines.append(f"- `{policy}` drives {plan_guard_text(per_policy[policy])}{beside}")
    return lines


def plan_guard_text(guard: dict) -> str:
    """The plan guard's settings in words (`stack.models.plan_guard`)."""
    if not guard.get("score"):
        return "the planner's best-scoring candidate (no plan guard)"
    rules = [f"detections scoring >= {guard['score']:g}",
             f"stopping at {guard['deceleration']:g} m/s^2 after the horizon"]
    if guard.get("reaction_s"):
        rules.append(f"always room to stop {guard['standoff_m']:g} m short of each after a {guard['reaction_s']:g}-s "
                     f"reaction at {guard['emergency_deceleration']:g} m/s^2")
    if guard.get("segmentation"):
        rules.append(f"ignoring those where the network's segmentation sees no road user (probability under "
                     f"{guard['segmentation']:g})")
    if guard.get("depth"):
        rules.append(f"ignoring those where the network's depth head puts no surface (probability under "
                     f"{guard['depth']:g} between the box's near face and its centre)")
    if guard.get("restart_s"):
        rules.append(f"moving on after {guard['restart_s']:g} s standing if the way is clear")
    return "through the plan guard (" + "; ".join(rules) + ")"


def latency_text(rows: list, meta: dict, policy: str) -> str:
    info, given = _policy_meta(meta, policy), (meta.get("latency") or {}).get(policy) or {}
    latency = _first(given, "ms") if given else info.get("latency_ms")
    if latency is None:
        values = [row["latency_ms"] for row in rows if row.get("policy") == policy and _finite(row.get("latency_ms"))]
        latency = sum(values) / len(values) if values else None
    how = given.get("how") or info.get("latency_source")
    if not latency and how and how.startswith("none"):
        text = how  # a baseline with no delay: "none (baseline)"
    else:
        text = ("not given" if latency is None else f"{latency:.1f} ms") + (f" ({how})" if how else "")
    return text + (f" — {info['description']}" if info.get("description") else "")


def bar_lines(meta: dict) -> list:
    """Each network against the blind policies: the gain per metric with its paired bootstrap interval, and the
    verdict (`stack.metrics.driving.closed_loop_bar`)."""
    lines = []
    for policy, bar in (meta.get("bar") or {}).items():
        if bar["passed"] is None:
            lines += [f"## The bar: `{policy}`: not judged (no blind policy drove beside it)", ""]
            continue
        verdict = ("within" if bar["passed"] else "below") if bar.get("information") else \
            ("PASS" if bar["passed"] else "FAIL")
        what = ("information: the network alone, without its plan guard, against the same bar" if bar.get("information")
                else "it must beat every blind policy in driving score and PDMS")
        lines += [f"## The bar: `{policy}` {verdict}: {what}", "",
                  "| against | metric | gain | 90% interval (paired bootstrap over episodes) | beats |",
                  "|---|---|---:|---|---|"]
        for c in bar["comparisons"]:
            lines.append(f"| `{c['baseline']}` | {c['metric']} | {c['gain']:+.3f} | [{c['low']:+.3f}, {c['high']:+.3f}] "
                         f"over {c['episodes']} episodes | {'yes' if c['beats'] else '**no**'} |")
        lines.append("")
    return lines


def interval_lines(rows: list, policies: list) -> list:
    """Driving score and PDMS of every policy over all its episodes, with 90% bootstrap intervals (episodes
    resampled): the figures to quote, beside the per-seed spread of the tables below."""
    from stack.metrics.driving import bootstrap_mean

    lines = ["## Every episode: mean and 90% bootstrap interval", "",
             "| policy | driving score | PDMS | episodes |", "|---|---|---|---:|"]
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        if not mine:
            continue
        cells = []
        for metric in ("driving_score", "pdms"):
            values = [r["metrics"][metric] for r in mine if metric in r.get("metrics", {})]
            i = bootstrap_mean(values) if values else None
            cells.append(f"{i['mean']:.3f} [{i['low']:.3f}, {i['high']:.3f}]" if i else "n/a")
        lines.append(f"| `{policy}` | {cells[0]} | {cells[1]} | {len(mine)} |")
    return lines + [""]


def comparison_lines(summary: dict, meta: dict, policies: list, families: list) -> list:
    """Per family: the best policy that uses the cameras against the best blind one, on driving score."""
    blind = [p for p in policies if is_blind(meta, p)]
    seeing = [p for p in policies if not is_blind(meta, p) and not is_privileged(meta, p)]
    if not blind or not seeing:
        return []
    lines = ["## Cameras against blind (driving score, mean ± std over seeds)", "",
             "| family | best policy with cameras | best blind policy | difference |", "|---|---|---|---|"]
    for family in [OVERALL] + families:
        best_seeing, best_blind = _best(summary, seeing, family), _best(summary, blind, family)
        if best_seeing is None or best_blind is None:
            continue
        (name_s, mean_s, std_s), (name_b, mean_b, std_b) = best_seeing, best_blind
        lines.append(f"| {family} | `{name_s}` {_cell(mean_s, std_s, False)} | `{name_b}` {_cell(mean_b, std_b, False)} "
                     f"| {mean_s - mean_b:+.3f} |")
    return lines + [""]


def _best(summary: dict, policies: list, family: str):
    scored = [(p, *_stat(summary, p, family, "driving_score")) for p in policies]
    scored = [row for row in scored if row[1] is not None]
    return max(scored, key=lambda row: row[1]) if scored else None


def table_lines(summary: dict, policies: list, family: str, meta: dict) -> list:
    """One row per policy, one column per metric: 'mean ± std', the best mean per column in bold."""
    present = [p for p in policies if family in summary[p]]
    lines = ["| policy | " + " | ".join(header for _, header, _ in COLUMNS) + " | episodes |",
             "|---|" + "---|" * (len(COLUMNS) + 1)]
    best = {key: _best_mean(summary, present, family, key, higher) for key, _, higher in COLUMNS}
    for policy in present:
        cells = []
        for key, _, _ in COLUMNS:
            mean, std = _stat(summary, policy, family, key)
            cells.append(_cell(mean, std, bold=mean is not None and mean == best[key]))
        lines.append(f"| {policy_label(meta, policy)} | " + " | ".join(cells) + f" | {_episodes(summary[policy][family])} |")
    return lines


def _best_mean(summary: dict, policies: list, family: str, key: str, higher: bool):
    """The best mean of a column; None (nothing bold) when fewer than two policies differ in it."""
    means = [m for m in (_stat(summary, p, family, key)[0] for p in policies) if m is not None]
    if len(set(means)) < 2:
        return None
    return max(means) if higher else min(means)


def _cell(mean, std, bold: bool) -> str:
    """'mean ± std'; the mean alone where there is no std (one seed); n/a where there is no mean."""
    text = "n/a" if mean is None else fmt(mean) if std is None else f"{fmt(mean)} ± {fmt(std)}"
    return f"**{text}**" if bold else text


def _stat(summary: dict, policy: str, family: str, key: str) -> tuple:
    """(mean, std) with None for missing or non-finite values."""
    entry = summary.get(policy, {}).get(family, {}).get(key)
    if not isinstance(entry, dict):
        return None, None
    mean, std = entry.get("mean"), entry.get("std")
    return (mean if _finite(mean) else None), (std if _finite(std) else None)


def _episodes(per_metric: dict) -> str:
    counts = {entry.get("episodes") for entry in per_metric.values() if isinstance(entry, dict)}
    counts.discard(None)
    return "/".join(str(c) for c in sorted(counts)) or "n/a"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value) -> str:
    """Three decimals (a difference over 0.01 always shows), one for large values; n/a for missing."""
    if value is None or not _finite(value):
        return "n/a"
    return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.3f}"


def worst_lines(rows: list, meta: dict, policies: list) -> list:
    """The lowest-driving-score episodes of each policy, with their clip files where clips were written."""
    clips = _clip_entries(meta, "worst")
    lines = ["## Worst episodes (lowest driving score per policy)", "",
             "| policy | episode | family | seed | driving score | PDMS | route completion | collisions | "
             "first collision (s) | clip |", "|---|---|---|---|---|---|---|---|---|---|"]
    for policy in policies:
        own = [row for row in rows if row.get("policy") == policy and _finite(row["metrics"].get("driving_score"))]
        order = lambda r: (r["metrics"]["driving_score"], _sortable(r["metrics"].get("pdms")), r.get("index", 0))
        shown = max(WORST_PER_POLICY, sum(owner == policy for owner, _ in clips))  # every clip gets its row
        for row in sorted(own, key=order)[:shown]:
            metrics = row["metrics"]
            clip = _clip_of(clips, policy, row.get("index"))
            lines.append(f"| {policy_label(meta, policy)} | {row.get('index')} | {row.get('family')} | {row.get('seed')} "
                         f"| {fmt(metrics['driving_score'])} | {fmt(metrics.get('pdms'))} | "
                         f"{fmt(metrics.get('route_completion'))} | {fmt(metrics.get('collisions'))} | "
                         f"{fmt(metrics.get('first_collision_s'))} | {f'`{clip}`' if clip else '—'} |")
    return lines + [""]


def best_lines(rows: list, meta: dict, policies: list) -> list:
    """The episodes replayed as each policy's best of their family (drive.best_clips), with their clips; nothing
    when none were."""
    clips = _clip_entries(meta, "best")
    if not clips:
        return []
    lines = ["## Best episode of each family (highest driving score per policy and family)", "",
             "| policy | family | episode | seed | driving score | PDMS | route completion | collisions | clip |",
             "|---|---|---|---|---|---|---|---|---|"]
    for policy in policies:
        own = {row.get("index"): row for row in rows if row.get("policy") == policy}
        for owner, entry in clips:
            row = own.get(entry.get("index")) if owner == policy else None
            if row is None:
                continue
            metrics = row["metrics"]
            lines.append(f"| {policy_label(meta, policy)} | {row.get('family')} | {row.get('index')} | {row.get('seed')} "
                         f"| {fmt(metrics['driving_score'])} | {fmt(metrics.get('pdms'))} | "
                         f"{fmt(metrics.get('route_completion'))} | {fmt(metrics.get('collisions'))} | `{entry['file']}` |")
    return lines + [""]


def time_lines(rows: list, meta: dict, policies: list) -> list:
    """Where each policy's episodes spent their wall time (the rows' "timings", seconds per episode)."""
    parts = ("render", "policy", "simulation", "wall")
    timed = [row for row in rows if isinstance(row.get("timings"), dict)]
    if not timed:
        return []
    seconds = (meta.get("episode_seconds") or meta.get("duration_s"))
    lines = ["## Where the time went (seconds per episode, mean over its episodes; one worker each)", "",
             "| policy | replans | " + " | ".join(parts) + " | simulated s per wall s |", "|---|" + "---|" * (len(parts) + 2)]
    for policy in policies:
        own = [row for row in timed if row.get("policy") == policy]
        if not own:
            continue
        mean = {part: sum(row["timings"].get(part, 0.0) for row in own) / len(own) for part in parts}
        replans = sum(row.get("replans", 0) for row in own) / len(own)
        rate = f"{seconds / mean['wall']:.2f}" if seconds and mean["wall"] > 0 else "n/a"
        lines.append(f"| {policy_label(meta, policy)} | {replans:.1f} | " + " | ".join(f"{mean[p]:.3f}" for p in parts)
                     + f" | {rate} |")
    return lines + [""]


def _sortable(value) -> float:
    return value if _finite(value) else math.inf


def _clip_entries(meta: dict, kind: str) -> list:
    """meta["clips"] of one kind ("worst" or "best") as [(policy, entry)], from either {policy: [entry]} or [entry
    with "policy"]; an entry without a kind is a worst-episode clip."""
    clips = meta.get("clips") or ()
    if isinstance(clips, dict):
        entries = [(policy, entry) for policy, own in clips.items() for entry in own]
    else:
        entries = [(entry.get("policy"), entry) for entry in clips]
    return [(policy, entry) for policy, entry in entries if entry.get("kind", "worst") == kind]


def _clip_of(clips: list, policy: str, index) -> str | None:
    for owner, entry in clips:
        if owner != policy or index is None:
            continue
        if entry.get("index") == index or ("index" not in entry and f"-ep{index:03d}." in str(entry.get("file"))):
            return entry.get("file")
    return None


# ---------------------------------------------------------------------------------------------- chart


def plot_scores(path: Path, summary: dict, meta: dict | None = None) -> Path:
    """Grouped bars: driving score and PDMS per family (and overall), policies side by side (best first, blind
    ones hatched), error bars the std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = policy_order(summary)
    meta = meta or {}
    families = family_order(summary, meta) + [OVERALL]
    width = 0.8 / max(len(policies), 1)
    figure, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(families) * max(1, len(policies)) ** 0.5 + 3), 7),
                                sharex=True)
    for ax, (key, title) in zip(axes, (("driving_score", "driving score"), ("pdms", "PDMS"))):
        top = 1.0
        for k, policy in enumerate(policies):
            stats = [_stat(summary, policy, family, key) for family in families]
            means = [m if m is not None else 0.0 for m, _ in stats]
            errors = [s if s is not None else 0.0 for _, s in stats]
            ax.bar([i - 0.4 + (k + 0.5) * width for i in range(len(families))], means, width, yerr=errors,
                   capsize=2, label=policy_label(meta, policy).replace("`", ""), color=plt.cm.tab10(k % 10),
                   hatch="//" if is_blind(meta, policy) else None, edgecolor="white", linewidth=0)
            top = max([top] + [m + e for m, e in zip(means, errors)])
        ax.set_ylabel(title)
        ax.set_ylim(0, 1.05 * top)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title("closed-loop scores per scenario family (mean ± std over seeds)", fontsize=10)
    axes[0].legend(fontsize=7, ncol=min(len(policies), 4))
    axes[1].set_xticks(range(len(families)), families, rotation=20, fontsize=8)
    figure.tight_layout()
    try:
        return write_atomic(path, writer=lambda temporary: figure.savefig(temporary, dpi=100, format="png"))
    finally:
        plt.close(figure)


def bar_summary(report: dict) -> list[str]:
    """One line per network policy of a finished drive (`stack.sim.drive_compare.read_drive`): does it clear the
    closed-loop bar (information for a network alone beside its guarded self)."""
    lines = []
    for policy, bar in (report["meta"].get("bar") or {}).items():
        if bar.get("passed") is None:
            verdict = "not judged (no blind policy drove beside it)"
        elif bar.get("information"):
            verdict = f"{'within' if bar['passed'] else 'below'} the bar (information: the network alone)"
        else:
            verdict = "clears the bar" if bar["passed"] else "BELOW the bar"
        lines.append(f"{report['file'].parent.name}: {policy}: {verdict}")
    return lines


if __name__ == "__main__":  # python -m stack.sim.drive_report DRIVE_JSON ...: which networks clear the bar
    import sys

    from stack.errors import StackError
    from stack.sim.drive_compare import read_drive

    try:
        print("\n".join(line for path in sys.argv[1:] for line in bar_summary(read_drive(path))))
    except StackError as exc:
        sys.exit(f"stack.sim.drive_report: {exc}")
