"""The quality gate of `stack deploy`: is the network good enough to ship, whatever its precision?

The other gates compare the shipped precision with fp32 and time it; none asks whether fp32 itself is any
good, so an untrained network would pass them all. This gate judges the fp32 network, before any INT8 budget:

(a) heads: its metrics on the validation frames clear every bar of `stack eval` (`stack.metrics.bars`:
    keep 80% of the tiny recipe's gain over each head's trivial baseline); planning's open-loop L2 and departure
    share are recorded as information: planning is judged by (b), where it drives;
(b) closed loop: on the held-out episodes the closed-loop gate drives, it beats each blind policy driven
    beside it (constant velocity, ego-status rollout) in driving score and PDMS, each with a 90% paired
    bootstrap interval of the gain above zero, episodes resampled whole (`stack.metrics.driving.closed_loop_bar`,
    the bar `stack drive` applies). A network that never looks at a camera drives; one that does must drive better.

A gate that could not judge (no validation evaluator, a bundle whose cameras the simulator does not render)
does not pass: "not judged" is not "good enough". `stack deploy --allow-below-bar` builds the bundle anyway for
experiments: the quality failures are listed as below the bar instead of failing the deploy, and gate.json's
`for_deployment` is false, which `stack.deploy.runner.DeployedNetwork.open` refuses unless asked.

Every figure a verdict rests on is recorded (the head metrics, each episode's scores per policy), so
`stack deploy --verify` decides both again (`recompute`).
"""

from __future__ import annotations

from stack.metrics.bars import HEAD_KEYS, all_judged_pass, verdict_word, verdicts
from stack.metrics.driving import closed_loop_bar, comparison_text

NETWORK = "fp32"
"""The policy name the closed-loop gate gives the fp32 model, the one this gate judges."""


def head_quality(metrics: dict | None, source: str) -> dict:
    """(a): {"passed", "rows", "metrics", "source"}; metrics None: not judged (fails)."""
    if metrics is None:
        return {"passed": False, "rows": [], "metrics": {}, "source": source,
                "not_judged": "no validation evaluator was given, so the heads were not scored"}
    recorded = {key: float(metrics[key]) for key in HEAD_KEYS if key in metrics}
    rows = [row.to_dict() for row in verdicts(recorded)]
    return {"passed": all_judged_pass(rows), "rows": rows, "metrics": recorded, "source": source}


def driving_quality(closed_loop: dict | None) -> dict:
    """(b) from the closed-loop gate's record: {"passed", "comparisons", "episodes"}, or not judged (fails)."""
    if not closed_loop:
        return {"passed": False, "comparisons": [], "not_judged": "the target drives no closed-loop episodes "
                "(closed_loop.episodes is 0): set it above 0 to judge the network's driving"}
    bar = closed_loop_bar(closed_loop["episode_scores"], NETWORK)
    return {"passed": bool(bar["passed"]), "comparisons": bar["comparisons"], "episodes": closed_loop["episodes"]}


def quality_verdict(heads: dict, driving: dict) -> dict:
    """The gate's record: both parts, the verdict, and one reason per failed bar."""
    return {"heads": heads, "closed_loop": driving, "passed": bool(heads["passed"] and driving["passed"]),
            "reasons": reasons(heads, driving)}


def reasons(heads: dict, driving: dict) -> list[str]:
    """One line per bar the network does not clear (what it scored, what the bar is)."""
    found = [f"quality: heads not judged: {heads['not_judged']}"] if "not_judged" in heads else []
    found += [f"quality: {row['head']} {row['metric']} {row['value']:.3f} does not clear its bar ({row['bar']}: "
              f"{row['threshold']:.3f} on these frames; trivial baseline {row['baseline']:.3f})"
              for row in heads["rows"] if not row["passed"] and row.get("judged", True)]
    if "not_judged" in driving:
        found.append(f"quality: closed loop not judged: {driving['not_judged']}")
    found += [f"quality: closed loop: the network does not beat {comparison_text(c)}"
              for c in driving["comparisons"] if not c["beats"]]
    return found


def recompute(quality: dict, closed_loop: dict | None) -> list[str]:
    """What in a recorded quality verdict does not follow from its recorded figures ([] when all does)."""
    problems = []
    recorded = quality["heads"]  # "not judged" is recomputed too: it fails, whatever the record claims
    heads = head_quality(None if "not_judged" in recorded else recorded["metrics"], recorded["source"])
    if heads["passed"] != quality["heads"]["passed"] or \
            [(r["passed"], r["judged"]) for r in heads["rows"]] != \
            [(r.get("passed"), r.get("judged", True)) for r in quality["heads"]["rows"]]:
        problems.append("the quality gate's head verdicts do not follow from its recorded head metrics")
    driving = driving_quality(closed_loop)
    if driving["passed"] != quality["closed_loop"]["passed"]:
        problems.append(f"the quality gate's closed-loop verdict says {quality['closed_loop']['passed']} but its "
                        f"episode scores say {driving['passed']}")
    if quality["passed"] != bool(heads["passed"] and driving["passed"]):
        problems.append("the quality verdict is not the conjunction of its head and closed-loop verdicts")
    return problems


def markdown(quality: dict, allowed: bool) -> list[str]:
    """report.md's quality section: the head table and the closed-loop comparisons."""
    verdict = "PASS" if quality["passed"] else ("BELOW THE BAR (--allow-below-bar: NOT FOR DEPLOYMENT)" if allowed
                                                  else "FAIL")
    lines = ["## Quality: is the network good enough to ship (fp32)", "", f"Verdict: **{verdict}**.", "",
             f"Heads on {quality['heads']['source']}, against `stack eval`'s bars (stack.metrics.bars: keep 80% of "
             "the tiny recipe's gain over each trivial baseline):", ""]
    if quality["heads"]["rows"]:
        lines += ["| head | metric | fp32 | trivial baseline | bar | |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['head']} | {r['metric']} | {r['value']:.3f} | {r['baseline']:.3f} | {r['bar']} "
                  f"({r['threshold']:.3f}) | {verdict_word(r['passed'], r.get('judged', True))} |" for r in quality["heads"]["rows"]]
        lines += ["", "Planning's open-loop figures (L2@3s, the departure share) are information: open-loop L2 does not "
                  "predict closed-loop driving (Bench2Drive: Spearman rho -0.16 over 9 methods), so planning is "
                  "judged by the closed-loop bar below."]
    driving = quality["closed_loop"]
    lines += ["", "Closed loop: the network must beat each blind policy driven on the same held-out episodes "
              "(90% paired bootstrap interval of the gain above 0):", ""]
    if driving["comparisons"]:
        lines += ["| against | metric | gain | 90% interval | |", "|---|---|---|---|---|"]
        lines += [f"| {c['baseline']} | {c['metric']} | {c['gain']:+.3f} | [{c['low']:+.3f}, {c['high']:+.3f}] | "
                  f"{'beats' if c['beats'] else 'does not beat'} |" for c in driving["comparisons"]]
    lines += [f"- {reason}" for reason in quality["reasons"]]
    return lines + [""]
