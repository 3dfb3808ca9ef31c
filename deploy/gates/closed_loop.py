"""The closed-loop gate of `stack deploy`: the INT8 model may not drive worse than the fp32 model, and
the blind policies drive beside them for the quality gate's driving bar (`stack.deploy.gates.quality`).

Per-head accuracy on recorded frames says little about driving: a planner whose waypoints move by
decimetres, or a detector that loses one pedestrian, can turn into a collision a few steps later,
and closed-loop errors compound (Codevilla et al. 2018, "On offline evaluation of vision-based driving
models"; Dauner et al. 2023, "Parting with misconceptions about learning-based vehicle motion
planning"). So both models drive the same held-out episodes (`target.closed_loop.episodes` of
`drive.scenarios` over `drive.seeds`), at the same latency, and the INT8 model fails when its mean
driving score drops by more than `driving_score_drop` or its at-fault collisions per episode rise by
more than `collision_rise`, or when either's 90% paired interval over episodes reaches past its budget
(inconclusive: fails unless `closed_loop.inconclusive_passes`). The targets' budgets and episode count are
derived (`stack.deploy.gates.closed_loop_budget`: the spread between training seeds, and a power calculation),
and the report says how likely the episodes driven were to catch a drop of the budget's size.

The blind policies (constant velocity, ego-status rollout) drive the same episodes: the fp32 network must
beat them (the quality gate), and where it does, so must INT8 (`int8_bar`): a drop within the budget can
still cost a small lead, and the INT8 model is what the car runs. On targets without INT8 only fp32 and the
blind policies drive. Each episode's scores are recorded (`episode_scores`) so `stack deploy --verify` can
decide the driving bar again.

Both run on ONNX Runtime on the deploying host, whatever the target: the gate judges the QDQ model's
quantization, not a TensorRT engine's own kernels (which cannot run here).

A bundle built for one vehicle (`stack deploy --calibration FILE`) is driven through that vehicle's cameras:
the simulator renders the calibration baked into the bundle (`stack.rig.CalibratedRig`: each camera's own K
and mount) instead of the nominal `data.rig`, so a calibration that ruins the network's view is caught here
as it would be on the road.

Both drive at the target's latency budget (network_share x the camera period): the worst latency the
FPS gate lets through, and one latency for both, so the comparison isolates what quantization did to
the network rather than its speed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from stack.deploy.gates.closed_loop_budget import derivation_line
from stack.metrics.driving import comparison_text, episode_key



NETWORK_ALONE = "fp32_alone"
"""The fp32 model driving its planner's own best candidate, without the plan guard: shown beside the guarded models
so a report says which part drives (nuPlan: PDM-Hybrid's learned offset adds nothing closed loop over the rules of
PDM-Closed)."""


def _means(rows: list[dict], name: str) -> dict:
    own = [r["metrics"] for r in rows if r["policy"] == name]
    return {"driving_score": float(np.mean([m["driving_score"] for m in own])),
            "pdms": float(np.mean([m["pdms"] for m in own])),
            "collisions_per_episode": float(np.mean([m["collisions"] for m in own])),
            "route_completion": float(np.mean([m["route_completion"] for m in own])),
            "episodes": len(own)}


def _paired(rows: list[dict]) -> list[dict]:
    """Episodes where INT8 scored lower than fp32, worst first (what the report lists)."""
    fp32 = {episode_key(r): r["metrics"] for r in rows if r["policy"] == "fp32"}
    worse = []
    for row in rows:
        if row["policy"] != "int8":
            continue
        other = fp32[episode_key(row)]
        drop = other["driving_score"] - row["metrics"]["driving_score"]
        if drop > 1e-9 or row["metrics"]["collisions"] > other["collisions"]:
            worse.append({"family": row["family"], "seed": row["seed"], "index": row["index"],
                          "int8_driving_score": row["metrics"]["driving_score"], "fp32_driving_score": other["driving_score"],
                          "int8_collisions": row["metrics"]["collisions"], "fp32_collisions": other["collisions"]})
    return sorted(worse, key=lambda w: w["int8_driving_score"] - w["fp32_driving_score"])


def closed_loop_gate(pipeline, int8_path: Path | None, fp32_path: Path, budget, latency_ms: float, log=print) -> dict:
    """Drive fp32, INT8 (unless None) and the blind policies on the same episodes; {"passed" (INT8 within the
    budget; None without INT8), "reasons", "int8", "fp32", "expert", "constant_velocity", "ego_rollout",
    "episode_scores", ...}."""
    from stack.deploy.calibration import Calibration
    from stack.deploy.network_policies import bundle_spec, guard_spec
    from stack.deploy.runner import DeployedNetwork
    from stack.pipeline import GuardConfig
    from stack.metrics.driving import BLIND_POLICIES
    from stack.sim.drive import evaluate
    from stack.sim.policies import PolicySpec
    from stack.sim.scenarios import episode_specs

    bundle_cameras = DeployedNetwork.from_model(fp32_path).calibration
    differences = bundle_cameras.compare(Calibration.from_rig(pipeline.data.rig))
    cameras = {"calibration": bundle_cameras.name or "unnamed", "hash": bundle_cameras.hash,
               "rendered": "the nominal data.rig" if not differences else "the bundle's own calibration"}
    if differences:  # a per-vehicle bundle: the world renders that vehicle's cameras, which the bundle pools for
        log(f"closed-loop gate: the simulator renders the bundle's calibration {cameras['calibration']!r} "
            f"({'; '.join(differences[:2])} from data.rig)")
        pipeline = replace(pipeline, data=replace(pipeline.data, rig=bundle_cameras.as_rig()))
    cfg = pipeline.drive
    episodes = episode_specs(list(cfg.scenarios), budget.episodes, list(cfg.seeds), cfg.episode_seconds)
    how = f"the target's latency budget ({latency_ms:.1f} ms), for {'both models' if int8_path else 'the model'}"
    models = {"int8": int8_path, "fp32": fp32_path} if int8_path else {"fp32": fp32_path}
    specs = [bundle_spec(name, "", str(path), latency_s=latency_ms / 1000.0, latency_how=how,
                         guard=guard_spec(pipeline.guard)) for name, path in models.items()]
    if pipeline.guard.score:  # the network alone beside it: which part drives (information, no verdict)
        specs.append(bundle_spec(NETWORK_ALONE, "", str(fp32_path), latency_s=latency_ms / 1000.0, latency_how=how,
                                 guard=guard_spec(GuardConfig()), alone_of="fp32"))
    specs += [PolicySpec(kind, kind) for kind in BLIND_POLICIES]
    title = "closed-loop gate (INT8 vs fp32, beside the blind policies)" if int8_path else \
        "closed-loop gate (fp32 beside the blind policies)"
    rows = evaluate(pipeline, specs, episodes, log, title=title)
    drove = {"episodes": len(episodes), "latency_ms": latency_ms, "latency_how": how, "cameras": cameras,
             "guard": pipeline.guard.settings(),
             "scenarios": list(cfg.scenarios),
             "seeds": list(cfg.seeds), "episode_seconds": cfg.episode_seconds, "replan_hz": cfg.replan_hz}
    return gate_record(rows, budget, bool(int8_path), drove)


def gate_record(rows: list[dict], budget, with_int8: bool, drove: dict) -> dict:
    """The gate's record from the scored rows of one drive (`stack.sim.drive.evaluate`): means per policy, each
    episode's scores, and INT8 against fp32 within the budget (passed None without INT8). `drove` says how."""
    from stack.metrics.driving import BLIND_POLICIES

    record = {**drove, "episode_scores": episode_scores(rows),
              **{name: _means(rows, name) for name in ("fp32", "expert", *BLIND_POLICIES)}}
    if any(r["policy"] == NETWORK_ALONE for r in rows):
        record[NETWORK_ALONE] = _means(rows, NETWORK_ALONE)
    if not with_int8:
        return {**record, "passed": None, "reasons": [], "int8": None}
    return {**record, **_int8_against_fp32(rows, budget, drove["episodes"])}


def episode_scores(rows: list[dict]) -> list[dict]:
    """Each episode's driving score and PDMS per policy: what the quality gate's paired bootstrap resamples."""
    return [{"policy": r["policy"], "family": r["family"], "seed": r["seed"], "index": r["index"],
             "metrics": {"driving_score": float(r["metrics"]["driving_score"]), "pdms": float(r["metrics"]["pdms"])}}
            for r in rows if r["policy"] != "expert"]


def _int8_against_fp32(rows: list[dict], budget, episodes: int) -> dict:
    """INT8's driving-score drop and collision rise against fp32 on the same episodes, with the budget's verdict:
    a mean beyond the budget fails; a mean within it whose paired 90% interval reaches past the budget is
    inconclusive, which fails unless the target accepts it (`closed_loop.inconclusive_passes`), as the accuracy
    gate's heads and the measured FPS bar do."""
    int8, fp32 = _means(rows, "int8"), _means(rows, "fp32")
    drop = fp32["driving_score"] - int8["driving_score"]
    rise = int8["collisions_per_episode"] - fp32["collisions_per_episode"]
    statistics = _statistics(rows, budget)
    reasons, inconclusive = [], []
    if drop > budget.driving_score_drop:
        reasons.append(f"closed loop: INT8 driving score {int8['driving_score']:.3f} is {drop:.3f} below fp32's "
                       f"{fp32['driving_score']:.3f} (budget {budget.driving_score_drop:g}) over {episodes} episodes")
    elif not statistics["driving_score_drop"]["within_surely"]:
        inconclusive.append("driving_score_drop")
    if rise > budget.collision_rise:
        reasons.append(f"closed loop: INT8 causes {int8['collisions_per_episode']:.3f} at-fault collisions per episode, "
                       f"{rise:.3f} more than fp32's {fp32['collisions_per_episode']:.3f} (budget {budget.collision_rise:g})")
    elif not statistics["collision_rise"]["within_surely"]:
        inconclusive.append("collision_rise")
    if inconclusive and not budget.inconclusive_passes:
        reasons += [_inconclusive_reason(name, statistics[name], getattr(budget, name)) for name in inconclusive]
    bar = int8_bar(rows)
    if bar["passed"] is False:
        reasons.append("closed loop: INT8 does not clear the bar fp32 clears: it does not beat "
                       + "; nor ".join(comparison_text(c) for c in bar["comparisons"] if not c["beats"]))
    return {"passed": not reasons, "reasons": reasons, "int8_bar": bar,
            "budget": {"driving_score_drop": budget.driving_score_drop, "collision_rise": budget.collision_rise,
                       "inconclusive_passes": budget.inconclusive_passes},
            "int8": int8, "driving_score_drop": drop, "collision_rise": rise, "int8_worse": _paired(rows)[:10],
            "inconclusive": inconclusive, "statistics": statistics}


def int8_bar(rows: list[dict]) -> dict:
    """The blind-policy bar (`closed_loop_bar`) applied to INT8 where fp32 clears it: a drop within the budget
    may still cost the lead over a policy that never looks at a camera, and what ships must keep it. None where
    fp32 does not clear it (the quality gate fails that network) or no blind policy drove."""
    from stack.metrics.driving import closed_loop_bar

    if closed_loop_bar(rows, "fp32")["passed"] is not True:
        return {"passed": None, "comparisons": []}
    return closed_loop_bar(rows, "int8")


def _inconclusive_reason(name: str, found: dict, size: float) -> str:
    return (f"closed loop: INT8's {name.replace('_', ' ')} is within the budget {size:g} on the mean, but its "
            f"{found['level']:.0%} interval [{found['low']:+.3f}, {found['high']:+.3f}] over {found['episodes']} "
            f"episodes reaches past it: inconclusive, which fails (about {found['episodes_needed']} episodes would "
            f"tell a change of the budget's size from none: raise closed_loop.episodes, or set "
            f"closed_loop.inconclusive_passes=true to accept it)")


def _statistics(rows: list[dict], budget) -> dict:
    """How sure the two comparisons are: the paired bootstrap interval of the drop and of the rise over whole
    episodes (the verdict's second half), and the episodes a power calculation asks for to tell a change of the
    budget's size from none (`stack.deploy.gates.accuracy.units_needed`)."""
    from statistics import NormalDist

    from stack.deploy.gates.accuracy import units_needed
    from stack.metrics.driving import paired_gain

    z = NormalDist().inv_cdf(0.95)
    found = {}
    for name, (better, worse, metric), size in (
            ("driving_score_drop", ("fp32", "int8", "driving_score"), budget.driving_score_drop),
            ("collision_rise", ("int8", "fp32", "collisions"), budget.collision_rise)):
        gain = paired_gain(rows, better, worse, metric)
        error = (gain["high"] - gain["low"]) / (2 * z)  # the 90% percentile interval's half-width in standard errors
        found[name] = {"low": gain["low"], "high": gain["high"], "level": gain["level"],
                       "episodes": gain["episodes"], "episodes_needed": units_needed(error, gain["episodes"], size),
                       "within_surely": bool(gain["high"] <= size + 1e-12)}
    return found


def _statistics_lines(statistics: dict | None) -> list[str]:
    """The intervals and the power calculation of the INT8 comparisons, said as what they are: information."""
    if not statistics:
        return []
    parts = [f"{name.replace('_', ' ')} {s['level']:.0%} interval [{s['low']:+.3f}, {s['high']:+.3f}] over "
             f"{s['episodes']} episodes ({'within the budget' if s['within_surely'] else 'reaching past the budget'}; "
             f"about {s['episodes_needed']} episodes would tell a change of the budget's size from none)"
             for name, s in statistics.items()]
    return ["", "How sure (paired bootstrap over whole episodes; a mean within the budget whose interval reaches "
                "past it is inconclusive): " + "; ".join(parts) + "."]


def _cameras_line(cameras: dict | None) -> list[str]:
    """What the simulator rendered: the nominal rig, or the per-vehicle calibration the bundle was built for."""
    if not cameras:
        return []
    return [f"Cameras: the simulator rendered {cameras['rendered']} (calibration {cameras['calibration']!r}, hash "
            f"{cameras['hash'][:12]}).", ""]


def _guard_lines(guard: dict | None) -> list[str]:
    """What the networks drove with: the plan guard's settings (the bundle ships them), and the network alone."""
    if not guard:
        return []
    from stack.sim.drive_report import plan_guard_text

    alone = f" `{NETWORK_ALONE}` is the fp32 model without it (information: which part drives)." if guard["score"] else ""
    return [f"The networks drive {plan_guard_text(guard)}: the post-processing this bundle ships.{alone}", ""]


def markdown(result: dict) -> list[str]:
    """The report.md section of the closed-loop gate."""
    int8 = result.get("int8") is not None
    verdict = ("PASS" if result["passed"] else "FAIL") if int8 else "no INT8 to judge"
    lines = [f"## Closed loop: {'INT8 against fp32' if int8 else 'fp32'} on held-out episodes, beside the blind policies",
             "", f"{result['episodes']} held-out episodes ({', '.join(result['scenarios'])}; seeds "
             f"{result['seeds']}; {result['episode_seconds']:g} s each, replanning at {result['replan_hz']:g} Hz), "
             f"latency {result['latency_how']}. INT8 against fp32: **{verdict}**; fp32 against the blind policies: "
             f"see Quality.", "", *_cameras_line(result.get("cameras")),
             "The models drive on ONNX Runtime on this host: the gate judges the INT8 model's quantization; a "
             "TensorRT engine built from it rounds in its own kernels (and FP16 fallbacks), which this does not drive.", "",
             *_guard_lines(result.get("guard")),
             "| policy | driving score | PDMS | route completion | at-fault collisions / episode |", "|---|---|---|---|---|"]
    for name in ("int8", "fp32", NETWORK_ALONE, "constant_velocity", "ego_rollout", "expert"):
        m = result.get(name)
        if m:
            lines.append(f"| {name} | {m['driving_score']:.3f} | {m['pdms']:.3f} | {m['route_completion']:.3f} | "
                         f"{m['collisions_per_episode']:.3f} |")
    if int8:
        lines += ["", f"Driving-score drop {result['driving_score_drop']:+.3f} (budget "
                  f"{result['budget']['driving_score_drop']:g}); collision rise {result['collision_rise']:+.3f} per "
                  f"episode (budget {result['budget']['collision_rise']:g})."]
        lines += _statistics_lines(result.get("statistics"))
        lines += ["", derivation_line(result["episodes"], result["budget"]["driving_score_drop"])]
    if result.get("int8_worse"):
        lines += ["", "Episodes INT8 drove worse: " + "; ".join(
            f"{w['family']} seed {w['seed']} #{w['index']} ({w['fp32_driving_score']:.2f} -> {w['int8_driving_score']:.2f})"
            for w in result["int8_worse"][:5])]
    lines += [f"- {r}" for r in result["reasons"]]
    return lines + [""]
