"""The deploy report: `report.md` for people, `gate.json` for machines, `latency.png` for the eye."""

from __future__ import annotations

from pathlib import Path


def write_gate_json(folder: Path, result: dict) -> Path:
    """gate.json, sealed with its own sha256 (`stack.deploy.bundle.seal`), so `--verify` notices an edit."""
    from stack.deploy.bundle import seal

    path = folder / "gate.json"
    path.write_text(seal(result))
    return path


def plot_latency(folder: Path, layers: list[tuple[str, str, float, str]], title: str, roofline=None) -> Path:
    """Per-layer latency bars (slowest 25) and, for predictions, the layers on the target's roofline.

    `layers`: (name, kind, ms, colour group); `roofline`: (points [(intensity, gflops, group)], peaks dict, GB/s).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 2 if roofline else 1
    figure, axes = plt.subplots(1, columns, figsize=(7 * columns, 7), squeeze=False)
    top = sorted(layers, key=lambda row: -row[2])[:25][::-1]
    groups = sorted({row[3] for row in top})
    colours = {g: PRECISION_COLOURS.get(g, plt.cm.tab10(i)) for i, g in enumerate(groups)}
    ax = axes[0][0]
    ax.barh(range(len(top)), [row[2] for row in top], color=[colours[row[3]] for row in top])
    ax.set_yticks(range(len(top)), [f"{_short(row[0])} ({row[1]})" for row in top], fontsize=6)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[g]) for g in groups], labels=groups, fontsize=7)
    if roofline:
        _roofline_axes(axes[0][1], *roofline)
    figure.tight_layout()
    path = folder / "latency.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


PRECISION_COLOURS = {"int8": "tab:green", "fp16": "tab:blue", "fp32": "tab:orange"}


def _roofline_axes(ax, points, peaks: dict, bandwidth_gbs: float) -> None:
    import numpy as np

    intensity = np.logspace(-1, 4, 200)
    for name, tera in peaks.items():
        if tera > 0:
            ax.loglog(intensity, np.minimum(tera * 1e3, intensity * bandwidth_gbs), label=f"{name} roof",
                      color=PRECISION_COLOURS.get(name.lower()))
    for group in sorted({p[2] for p in points}):
        chosen = [p for p in points if p[2] == group and p[0] > 0 and p[1] > 0]
        ax.scatter([p[0] for p in chosen], [p[1] for p in chosen], s=10, label=f"layers ({group})",
                   color=PRECISION_COLOURS.get(group))
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attained GFLOP/s (predicted)")
    ax.set_title("predicted per-layer roofline", fontsize=9)
    ax.legend(fontsize=7)


def _short(name: str) -> str:
    return name if len(name) <= 48 else "..." + name[-45:]


def verdict_line(result: dict) -> str:
    """PASS, FAIL, or PASS with the NOT FOR DEPLOYMENT mark of a bundle built below the quality bar."""
    if not result["passed"]:
        return "FAIL"
    return "PASS" if result.get("for_deployment") else "PASS, NOT FOR DEPLOYMENT (below the quality bar)"


def markdown(result: dict, files: list = ()) -> str:
    """report.md from the gate result dict that gate.json also holds, listing the bundle's `files`."""
    lines = [f"# Deploy report: {result['target']} — {verdict_line(result)}", "",
             f"- Target: {result['target_description']} (runtime {result['runtime']}, precision {result['precision']}, "
             f"QDQ flavour {result['qdq_flavour']})",
             f"- Pipeline: {result['pipeline_name']} (sha256 {result['pipeline_hash']}); checkpoint {result['checkpoint']}",
             f"- Validation samples: {result['samples_source']}", ""]
    if result.get("camera_calibration"):
        cameras = result["camera_calibration"]
        lines[-1:-1] = [f"- Camera calibration: {cameras['name'] or 'unnamed'} (hash {cameras['hash'][:16]}…, "
                        f"calibration.yaml): the network pools for these cameras only; the runtime refuses others"]
    if result.get("failures"):
        lines += ["## Why it failed", ""] + [f"- {reason}" for reason in result["failures"]] + [""]
    if result.get("below_bar"):
        lines += ["## NOT FOR DEPLOYMENT: below the quality bar", "",
                  "Built with --allow-below-bar for experiments; the runtime refuses to open this bundle unless asked "
                  "(`DeployedNetwork.open(..., allow_below_bar=True)`; `stack drive` drives it in simulation).", ""]
        lines += [f"- {reason}" for reason in result["below_bar"]] + [""]
    if result.get("shipped"):
        shipped = result["shipped"]
        lines += [f"**Shipped: `{shipped['file']}` ({shipped['precision']})** — {shipped['why']}.", ""]
    lines += _quality_section(result) + _accuracy_section(result.get("accuracy"))
    lines += _closed_loop_section(result.get("closed_loop"))
    lines += _speed_section(result["fps"], result.get("speed", {}))
    lines += _export_section(result["export"]) + _files_section(files)
    return "\n".join(lines) + "\n"


def _quality_section(result: dict) -> list:
    from stack.deploy.gates.quality import markdown as quality_markdown

    return quality_markdown(result["quality"], result.get("allow_below_bar", False)) if result.get("quality") else []


def _closed_loop_section(closed_loop: dict | None) -> list:
    if not closed_loop:
        return []
    from stack.deploy.gates.closed_loop import markdown as closed_loop_markdown

    return closed_loop_markdown(closed_loop)


def _accuracy_section(accuracy: dict | None) -> list:
    if not accuracy:
        return ["## Accuracy", "", "No INT8: the target runs fp16/fp32, so there is nothing to gate.", ""]
    boot = accuracy.get("bootstrap", {})
    level = f"{boot.get('level', 0):.0%}"
    lines = ["## Accuracy per head (fp32 vs INT8, same validation samples)", "",
             f"| head | metric | fp32 | INT8 | drop | {level} interval of the drop | budget | |",
             "|---|---|---|---|---|---|---|---|"]
    for head in accuracy["heads"]:
        interval = "n/a" if head.get("low") is None or head["low"] != head["low"] else \
            f"[{head['low']:+.4f}, {head['high']:+.4f}]"
        verdict = "pass" if head["passed"] else "FAIL"
        if not head.get("judged", True):
            verdict = (f"information ({'within' if head['passed'] else 'beyond'} the budget): judged by the "
                       f"closed-loop gate's INT8 driving-score drop")
        elif not head.get("conclusive", True):
            unit, units = head.get("unit", "frames"), head.get("units", head["frames"])
            verdict += f" (inconclusive at {units} {unit}; about {head.get('units_needed', '?')} resolve the budget)"
        elif head.get("loses_prior"):
            verdict += f" (INT8 loses to its prior: bar {head['prior_bar']:.4f})"
        lines.append(f"| {head['head']} | {head['metric']} | {head['fp32']:.4f} | {head['quantized']:.4f} | "
                     f"{head['drop']:+.4f} | {interval} | {head['budget']:g} | {verdict} |")
    lines += [""] + _information_lines(accuracy)
    if boot:
        unit = boot.get("unit", "frames")
        whole = "whole validation scenes, whose frames err together" if unit == "scenes" else "frames"
        lines += [f"Intervals: paired bootstrap over {whole} ({boot['resamples']} resamples, {level} percentile "
                  f"interval; fp32 and INT8 rescored on the same resample). Rule: {boot['rule']}. Power: the {unit} "
                  f"that would tell a drop of each budget's size from none at the interval's upper end, with "
                  f"probability {boot.get('power', 0.9):.0%}: " + ", ".join(
                      f"{h['head']} {h.get('units_needed', 0)}" for h in accuracy["heads"])
                  + f" (scored: {accuracy['heads'][0].get('units', accuracy['heads'][0]['frames'])}).", ""]
    samples = accuracy.get("samples") or {}
    if samples:
        lines += ["Samples: " + "; ".join(f"{job} {len(ids)} ({_id_range(ids)})" for job, ids in samples.items())
                  + " — calibration and sensitivity from the training split, accuracy from validation.", ""]
    pinned = accuracy.get("keep_fp32")
    if pinned:
        lines += [f"Never quantized (export.keep_fp32 {pinned['patterns']}): {pinned['nodes']} nodes"
                  + (" — no node matched, check the patterns" if pinned["patterns"] and not pinned["nodes"] else "") + ".", ""]
    if accuracy["excluded"]:
        lines += [f"Kept in fp32 by the accuracy gate ({len(accuracy['excluded'])} layers, most sensitive first): "
                  + ", ".join(f"`{name}`" for name in accuracy["excluded"]), ""]
    if len(accuracy["attempts"]) > 1:
        lines += ["Attempts: " + "; ".join(f"{len(a['excluded'])} fp32 layers -> {'pass' if a['passed'] else 'fail'}"
                                           for a in accuracy["attempts"]), ""]
    return lines


def _information_lines(accuracy: dict) -> list:
    """The detection head beyond mAP, fp32 and INT8, as information (no budget): NDS and its TP errors."""
    from stack.metrics.detection import summary

    rows = [(name, accuracy.get(key) or {}) for name, key in (("fp32", "fp32_metrics"), ("INT8", "quantized_metrics"))]
    rows = [f"- {name}: {summary(metrics)}" for name, metrics in rows if "detection/NDS" in metrics]
    return ["Detection beyond mAP (information, no budget; nuScenes NDS, stack.metrics.detection):", ""] + rows + [""] \
        if rows else []


def _id_range(ids: list) -> str:
    return ", ".join(ids) if len(ids) <= 3 else f"{ids[0]} ... {ids[-1]}"


def _speed_section(fps: dict, speed: dict) -> list:
    verdict = "pass" if fps["passed"] else "FAIL"
    lines = ["## Speed", "", f"**{fps['mode'].upper()}**: {fps['fps']:.1f} FPS (median {fps['median_ms']:.2f} ms), "
             f"p99 {fps['p99_ms']:.2f} ms; required {fps['min_fps']:g} FPS and p99 <= {fps['max_p99_ms']:g} ms: **{verdict}**",
             ""] + _budget_lines(fps) + [f"How: {fps['how']}.", ""]
    if speed.get("side_by_side"):
        lines += ["| model | median ms | p99 ms |", "|---|---|---|"]
        lines += [f"| {name} | {row['median_ms']:.2f} | {row['p99_ms']:.2f} |" for name, row in speed["side_by_side"].items()]
        lines.append("")
    if speed.get("breakdown"):
        lines += ["Latency breakdown (slowest layers; full table in gate.json, plot in latency.png):", "",
                  "| layer | ops | precision / bound | ms |", "|---|---|---|---|"]
        lines += [f"| `{row[0]}` | {row[1]} | {row[3]} | {row[2]:.3f} |" for row in speed["breakdown"][:15]]
        lines.append("")
    if speed.get("classes"):
        lines += ["What the prediction rests on, per operator class (`stack.deploy.latency.margins.CLASS_PINNING`); "
                  f"the margin carries x{speed.get('unpinned_factor', 1.0):.3f} for the unpinned ones:", "",
                  "| class | predicted ms | share | pinned by | error |", "|---|---:|---:|---|---|"]
        lines += [f"| {c['class']} | {c['ms']:.3f} | {c['share']:.0%} | {c['pinned_by']} | {c['error']} |"
                  for c in speed["classes"]]
        lines.append("")
    return lines


def _budget_lines(fps: dict) -> list:
    """The latency budget the bars come from, and how much of it the network uses."""
    if not fps.get("budget_ms"):
        return []
    return [f"Budget: cameras at {fps['camera_hz']:g} Hz give a {fps['frame_period_ms']:.1f} ms frame period; the "
            f"network's share is {fps['budget_ms']:.1f} ms. Median latency {fps['median_ms']:.2f} ms uses "
            f"{fps['period_used']:.1%} of the frame period: headroom {fps['headroom']:.2f}x (budget / latency).", ""]


def _export_section(export: dict) -> list:
    lines = ["## Export", "", "Operators: " + ", ".join(f"{op} x{n}" for op, n in export["ops"].items()), ""]
    problems = export.get("tensorrt_problems") or []
    lines.append("TensorRT operator check (8.6 and 10.3): " + ("all native." if not problems else "; ".join(problems)))
    lines += ["", "| output | max abs error (ONNX Runtime vs PyTorch) | tolerance | |", "|---|---|---|---|"]
    lines += [f"| {row['output']} | {row['max_abs_error']:.2e} | {row['tolerance']:.2e} | "
              f"{'pass' if row['passed'] else 'FAIL'} |" for row in export["parity"]]
    return lines + [""]


def _files_section(files: list) -> list:
    return ["## Files", ""] + [f"- `{name}`" for name in files] + [""]
