"""Recompute a bundle's verdicts from the figures and budgets its gate.json records.

gate.json's sha256 (`stack.deploy.bundle`) says the file is the one `stack deploy` wrote, but anyone who
edits it can compute a new sha256; what a hand edit cannot do is make a verdict disagree with its own
figures. So `stack deploy --verify` decides every gate again, as `stack.deploy.orchestrate` did, from
what gate.json records (parity errors and tolerances, per-head drops and budgets, the closed-loop scores
and budget, the quality gate's head metrics and per-episode driving scores, the latencies and FPS bars),
checks which model the bundle must ship, and refuses a gate.json
whose verdicts, failures or shipped model differ from that.
"""

from __future__ import annotations

import math

from stack.errors import StackError

INT8, FP32 = "model.int8.onnx", "model.onnx"
_TOLERANCE = 1e-9
"""Relative tolerance on a figure derived from others (JSON keeps floats exactly; this only absorbs rounding)."""


def verdict_problems(gate: dict) -> list[str]:
    """What in gate.json does not follow from its own figures ([] when every verdict does)."""
    try:
        return _problems(gate)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, StackError) as exc:
        return [f"a gate's record is missing or misshapen ({type(exc).__name__}: {str(exc)[:120]})"]


def _problems(gate: dict) -> list[str]:
    """The checks of `verdict_problems`, which turns any misshapen record into a problem."""
    decided = {"parity": _parity_passed(gate), "accuracy": _accuracy_passed(gate.get("accuracy")),
               "closed loop": _closed_loop_passed(gate.get("closed_loop")), "fps": _fps_passed(gate["fps"])}
    recorded = {"accuracy": (gate.get("accuracy") or {}).get("passed"),
                "closed loop": (gate.get("closed_loop") or {}).get("passed"), "fps": gate["fps"]["passed"]}
    problems = [f"the {name} verdict says {recorded[name]} but its figures say {decided[name]}"
                for name in recorded if decided[name] is not None and recorded[name] != decided[name]]
    shipped, expected = gate["shipped"]["file"], expected_shipped(gate)
    if shipped != expected:
        problems.append(f"it ships {shipped!r}, but its figures choose {expected!r}")
    problems += _timing_problems(gate, shipped)
    problems += _quality_problems(gate)
    fails = [name for name, ok in decided.items() if ok is False and not _excused(gate, name, expected)]
    fails += ["quality"] * (not gate["quality"]["passed"] and not gate["allow_below_bar"])
    fails += ["TensorRT import"] * bool(gate.get("export", {}).get("tensorrt_problems"))
    if gate["passed"] and (fails or gate.get("failures")):
        problems.append(f"the overall verdict is PASS, but {', '.join(fails) or 'its failures list'} failed")
    if not gate["passed"] and not gate.get("failures"):
        problems.append("the overall verdict is FAIL, but no failure is listed")
    return problems


def _quality_problems(gate: dict) -> list[str]:
    """The quality verdict decided again from its recorded figures, and the deployment mark it implies."""
    from stack.deploy.gates.quality import recompute

    quality = gate["quality"]
    problems = recompute(quality, gate.get("closed_loop"))
    if bool(gate["for_deployment"]) != bool(gate["passed"] and quality["passed"]):
        problems.append(f"for_deployment says {gate['for_deployment']}, but the verdict ({gate['passed']}) and the "
                        f"quality verdict ({quality['passed']}) say {gate['passed'] and quality['passed']}")
    if gate["below_bar"] != (quality["reasons"] if gate["allow_below_bar"] else []):
        problems.append("the list of bars the network is below does not match the quality verdict")
    return problems


def _near(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=_TOLERANCE, abs_tol=1e-12)


def _parity_passed(gate: dict) -> bool:
    return all(row["max_abs_error"] <= row["tolerance"] for row in gate["export"]["parity"])


def _accuracy_passed(accuracy: dict | None) -> bool | None:
    """Every head within its budget, still beating its prior's bar, and sure of it: its interval below the budget
    unless the target lets an inconclusive head pass (`accuracy.HeadResult.passed`; a bundle written before heads
    recorded `inconclusive_passes` was judged on point estimates)."""
    if accuracy is None:
        return None
    heads = accuracy["heads"]
    return bool(heads) and all(_head_passed(h) or not h.get("judged", True) for h in heads)


def _head_passed(head: dict) -> bool:
    within = head["drop"] <= head["budget"] + 1e-12 and not (head["fp32"] <= head["prior_bar"] < head["quantized"])
    low, high = float(head["low"]), float(head["high"])
    conclusive = math.isnan(low) or math.isnan(high) or high <= head["budget"] + 1e-12 or low > head["budget"] + 1e-12
    return within and (conclusive or bool(head.get("inconclusive_passes", True)))


def _closed_loop_passed(closed_loop: dict | None) -> bool | None:
    """INT8's driving-score drop and collision rise against fp32 within the budget, and INT8 clearing the blind-
    policy bar where fp32 does (None: the gate did not run)."""
    from stack.deploy.gates.closed_loop import int8_bar

    if not closed_loop or "skipped" in closed_loop or closed_loop.get("int8") is None:  # "skipped": older bundles
        return None
    drop = closed_loop["fp32"]["driving_score"] - closed_loop["int8"]["driving_score"]
    rise = closed_loop["int8"]["collisions_per_episode"] - closed_loop["fp32"]["collisions_per_episode"]
    if not (_near(drop, closed_loop["driving_score_drop"]) and _near(rise, closed_loop["collision_rise"])):
        return False
    budget, means = closed_loop["budget"], {"driving_score_drop": drop, "collision_rise": rise}
    within = all(means[name] <= budget[name] for name in means)
    statistics = closed_loop.get("statistics") or {}
    unsure = [name for name, found in statistics.items()
              if means[name] <= budget[name] and found["high"] > budget[name] + 1e-12]
    if "inconclusive" in closed_loop and unsure != list(closed_loop["inconclusive"]):
        return False  # older bundles record no "inconclusive": their verdicts were on the means
    # from the scores, not the record; bundles gated before INT8 was held to the bar record no "int8_bar"
    keeps_the_bar = "int8_bar" not in closed_loop or int8_bar(closed_loop["episode_scores"])["passed"] is not False
    return within and keeps_the_bar and (not unsure or bool(budget.get("inconclusive_passes", True)))


def _fps_passed(fps: dict) -> bool:
    """The FPS and p99 bars on the (scaled) latencies, as `gates.fps.decide` applies them: the median bar on
    the normalised repeats when there are any (pass / fail / inconclusive, inconclusive failing unless the
    target lets it pass), and the recorded verdict must be the one the figures give."""
    from stack.deploy.gates.fps import median_verdict

    scaled = _near(fps["median_ms"], fps["raw_median_ms"] * fps["scale"]) and \
        _near(fps["p99_ms"], fps["raw_p99_ms"] * fps["scale"])
    bar_ms = 1000.0 / fps["min_fps"]
    verdict = median_verdict(fps["median_ms"], fps.get("repeats_ms") or [], bar_ms)
    fast = verdict == "pass" or (verdict == "inconclusive" and bool(fps.get("inconclusive_passes")))
    tail = fps["p99_ms"] <= fps["max_p99_ms"]
    recorded = fps.get("verdict")
    consistent = recorded is None or recorded == (verdict if tail else "fail")
    return bool(scaled and fast and tail and consistent)


def expected_shipped(gate: dict) -> str:
    """The model `stack deploy` ships given gate.json's figures (`orchestrate._choose_shipped`)."""
    if gate.get("accuracy") is None:
        return FP32
    if not _may_ship_fp32(gate):
        return INT8
    if not _accuracy_passed(gate["accuracy"]) or _closed_loop_passed(gate.get("closed_loop")) is False:
        return FP32
    times = gate["speed"]["side_by_side"]
    return INT8 if times[INT8]["median_ms"] < times[FP32]["median_ms"] else FP32


def _may_ship_fp32(gate: dict) -> bool:
    return gate["runtime"] == "onnxruntime" and gate["precision"] == "best"


def _excused(gate: dict, name: str, shipped: str) -> bool:
    """An INT8 gate that failed on a `best` ONNX Runtime target whose bundle ships fp32 instead."""
    return name in ("accuracy", "closed loop") and _may_ship_fp32(gate) and shipped == FP32


def _timing_problems(gate: dict, shipped: str) -> list[str]:
    """ONNX Runtime targets time the shipped model here: the FPS gate's raw median is that model's median, and
    its repeats are that model's round medians normalised by the reference block timed after each round."""
    if gate["runtime"] != "onnxruntime":
        return []
    from stack.deploy.gates.fps import normalised_repeats
    from stack.deploy.runtime import LatencyStats

    timed = gate["speed"]["side_by_side"][shipped]
    problems = []
    if not _near(timed["median_ms"], gate["fps"]["raw_median_ms"]):
        problems.append(f"the FPS gate's median {gate['fps']['raw_median_ms']} ms is not {shipped}'s timed median "
                        f"{timed['median_ms']} ms")
    stats = LatencyStats(**{k: timed[k] for k in LatencyStats.__dataclass_fields__ if k in timed})
    expected = normalised_repeats(stats, gate["fps"].get("reference_workload_ms", 0.0))
    recorded = gate["fps"].get("repeats_ms") or []
    if len(expected) != len(recorded) or not all(_near(a, b) for a, b in zip(expected, recorded)):
        problems.append(f"the FPS gate's repeats {recorded} are not {shipped}'s round medians normalised by the "
                        f"reference blocks ({[round(v, 4) for v in expected]})")
    return problems
