"""Why does the plan guard overrule the planner? Every override of a drive, held against the ground truth.

Drives a checkpoint with the plan guard (`stack.models.plan_guard`) on a split's episodes and, at every replan where
the guard drives another candidate than the planner's favourite, looks at each detection that rules the favourite
out: a false positive if no road user lies within `MATCH_M` of it; otherwise a true one, which would still rule the
favourite out at the road user's true velocity ("real") or would not ("velocity error"). Prints the counts, the
false-positive share per detection score, and the velocity error of the matched ones
(docs/log/2026-11-27_guard-restart-confirmation.md), and for each kind how strongly the network's own segmentation
sees a road user where the culprit lies (`stack.models.plan_guard.segmentation_support`, at the centre cell and over
growing shares of the box's image rectangle): what `guard.segmentation` was chosen from
(docs/log/2026-11-29_guard-segmentation-check.md). Last, where the false positives lie against the road users'
camera rays: how many sit on one (within RAY_DEGREES of its bearing from the cameras), nearer or farther than the
road user, whether that road user was detected as well, and the bearing differences per degree (a peak at zero is a
detector that places road users along their ray; a flat count is chance in a crowded scene).

    python benchmarks/guard_overrides.py runs/k1-s0/train/model.pt -c configs/pipeline.yaml \\
        -c configs/presets/tiny.yaml -c configs/presets/tiny-drive.yaml model.temporal_frames=1 \\
        guard.score=0.2 drive.split=tuning drive.latency_ms=71.1
"""

from __future__ import annotations

import argparse
import collections
import math
from dataclasses import dataclass

import numpy as np

MATCH_M = 2.5
"""A detection within this of a road user's centre is that road user (3.5x the tiny-drive network's mATE)."""
EXTENTS = (0.0, 0.25, 0.5, 1.0)
"""Shares of a culprit's image rectangle, around its centre, its segmentation support is read over (0: the centre
cell, as `guard.segmentation` reads it)."""
SUPPORT_CUTS = (0.1, 0.2, 0.3, 0.5)
DEPTH_CUTS = (0.02, 0.05, 0.1, 0.2, 0.3)
SCORE_BINS = (0.0, 0.25, 0.3, 0.4, 0.6, 1.0)


@dataclass(frozen=True)
class Culprit:
    """A detection that alone rules out the planner's favourite candidate."""

    score: float
    kind: str
    """"false positive" (no road user within MATCH_M), "real" (still rules the favourite out at the road user's
    true velocity) or "velocity error" (would not)."""
    velocity_error: float | None
    """m/s between the detected and the matched road user's velocity; None for a false positive."""
    support: tuple
    """The segmentation support at each of EXTENTS."""
    label: str
    range_m: float
    """Distance from the cameras' mean position to the culprit's centre."""
    ray: tuple | None = None
    """For a false positive: (bearing difference in degrees, detected range / true range, duplicated) of the road
    user nearest its camera ray (the smallest bearing difference), where `duplicated` says another detection lies
    within MATCH_M of that road user; None for a true culprit or when no road user is in view."""
    depth: tuple = ()
    """The depth support (`stack.models.plan_guard.depth_support`) at each of EXTENTS."""
    shadow_degrees: float = math.inf
    """Bearing difference to the nearest-bearing detection that lies farther along the ray and scores higher: what a
    rule "a detection in front of a stronger one on its ray is its smear" would read (inf: none)."""


RAY_DEGREES = 5.0
"""A false positive within this bearing of a road user lies on that road user's camera ray."""


def ray_relation(box_xy: np.ndarray, truth: np.ndarray, others: np.ndarray, origin: np.ndarray) -> tuple | None:
    """(bearing difference, range ratio, duplicated) of the road user nearest the ray through `box_xy` from
    `origin` (ego frame); `others` are the other detections' (x, y)."""
    if not len(truth):
        return None
    seen, true = box_xy - origin, truth[:, :2] - origin
    bearing = np.degrees(np.abs(np.angle(np.exp(1j * (np.arctan2(true[:, 1], true[:, 0])
                                                       - math.atan2(seen[1], seen[0]))))))
    nearest = int(bearing.argmin())
    duplicated = bool(len(others)) and bool((np.hypot(*(others - truth[nearest, :2]).T) < MATCH_M).any())
    return float(bearing[nearest]), float(np.hypot(*seen) / max(np.hypot(*true[nearest]), 1e-6)), duplicated


def shadow_degrees(index: int, centres: np.ndarray, scores: np.ndarray, origin: np.ndarray) -> float:
    """`Culprit.shadow_degrees` of detection `index` among detections at `centres` (M, 2) with `scores` (M,)."""
    rays = centres - origin
    ranges, bearings = np.hypot(*rays.T), np.arctan2(rays[:, 1], rays[:, 0])
    stronger = (ranges > ranges[index]) & (scores > scores[index])
    if not stronger.any():
        return math.inf
    return float(np.degrees(np.abs(np.angle(np.exp(1j * (bearings[stronger] - bearings[index]))))).min())


def road_users_in_ego_frame(world) -> np.ndarray:
    """(A, 4) x, y, vx, vy of every other road user now, in the ego frame (velocities over ground)."""
    now, (x, y, yaw) = world.agents_now(), world.ego_state()[:3]
    c, s = math.cos(yaw), math.sin(yaw)
    d = now["boxes"][:, :2] - (x, y)
    heading = now["boxes"][:, 2] - yaw
    return np.stack([d[:, 0] * c + d[:, 1] * s, -d[:, 0] * s + d[:, 1] * c,
                     now["speed"] * np.cos(heading), now["speed"] * np.sin(heading)], axis=1)


def culprits(trajectories, favourite: int, detected, truth: np.ndarray, deceleration: float, support,
             classes, origin: np.ndarray, depth_seen) -> list[Culprit]:
    """The detections (`Detections`, with their (M, len(EXTENTS)) segmentation `support`) that alone rule out the
    favourite candidate."""
    from stack.models.plan_guard import colliding_candidates

    found = []
    centres = detected.boxes[:, :2].numpy().astype(np.float64)
    all_scores = detected.scores.numpy().astype(np.float64)
    for index, (box, score, label, seen, depth) in enumerate(zip(detected.boxes, detected.scores.tolist(),
                                                                detected.labels.tolist(), support.tolist(),
                                                                depth_seen.tolist())):
        if not colliding_candidates(trajectories, box[None], deceleration)[favourite]:
            continue
        range_m = float(np.hypot(*(centres[index] - origin)))
        shadow = shadow_degrees(index, centres, all_scores, origin)
        distance = np.hypot(truth[:, 0] - float(box[0]), truth[:, 1] - float(box[1])) if len(truth) else np.array([])
        if not len(distance) or distance.min() > MATCH_M:
            others = np.delete(centres, index, axis=0)
            found.append(Culprit(score, "false positive", None, tuple(seen), classes[label], range_m,
                                 ray_relation(centres[index], truth, others, origin), tuple(depth), shadow))
            continue
        true = truth[int(distance.argmin())]
        corrected = box.clone()
        corrected[7:9] = corrected.new_tensor(true[2:4])
        still = bool(colliding_candidates(trajectories, corrected[None], deceleration)[favourite])
        found.append(Culprit(score, "real" if still else "velocity error",
                             float(np.hypot(*(box[7:9].numpy() - true[2:4]))), tuple(seen), classes[label], range_m,
                             None, tuple(depth), shadow))
    return found


def overrides(checkpoint: str, pipeline) -> tuple[collections.Counter, list[Culprit]]:
    """Replans, overrides by the kinds of their culprits, and every culprit of a drive of `pipeline.drive`."""
    import torch

    from stack.deploy.network_policies import checkpoint_spec
    from stack.models.post_processing import depth_probabilities, road_user_probabilities
    from stack.models.decoders import Detections, decode_detections
    from stack.models.plan_guard import depth_support, segmentation_support
    from stack.rig import rig_matrices
    from stack.sim.drive import episodes_of
    from stack.sim.episode import run_episode
    from stack.sim.policies import build_policy
    from stack.sim.scenarios import build_world

    model, rig = pipeline.model, pipeline.data.rig
    latency = pipeline.drive.latency_ms if pipeline.drive.latency_ms >= 0 else 0.0
    policy = build_policy(checkpoint_spec("checkpoint", checkpoint, latency_s=latency / 1000, latency_how="given"),
                          pipeline)
    ks, poses = (torch.from_numpy(m) for m in rig_matrices(rig))
    origin = poses[:, :2, 3].double().mean(0).numpy()  # the cameras' mean position, ego frame
    counts, found, guarded = collections.Counter(), [], policy.choose
    for number, spec in enumerate(episodes_of(pipeline), 1):
        world = build_world(spec, pipeline.data.world, 1 / pipeline.drive.sim_hz)

        def choose(outputs, world=world):
            plan = guarded(outputs)
            trajectories = torch.from_numpy(outputs["plan_trajectories"][0])
            favourite = int(np.argmax(outputs["plan_scores"][0]))
            counts["replans"] += 1
            if np.allclose(plan, outputs["plan_trajectories"][0, favourite]):
                return plan
            detected = decode_detections({k: torch.from_numpy(outputs[k]) for k in ("heatmap", "box_regression")},
                                         pipeline)[0]
            keep = detected.scores >= pipeline.guard.score
            detected = Detections(detected.boxes[keep], detected.scores[keep], detected.labels[keep])
            things = road_user_probabilities(outputs["seg_logits"], model)
            support = torch.stack([segmentation_support(detected.boxes, things, ks, poses,
                                                        (rig.image_height, rig.image_width), extent)
                                   for extent in EXTENTS], dim=1)
            depth_probs = depth_probabilities(outputs["depth_logits"])
            depth_seen = torch.stack([depth_support(detected.boxes, depth_probs, (model.depth.min_m, model.depth.max_m),
                                                    ks, poses, (rig.image_height, rig.image_width), extent)
                                      for extent in EXTENTS], dim=1)
            these = culprits(trajectories, favourite, detected, road_users_in_ego_frame(world),
                             pipeline.guard.deceleration, support, model.detection_classes, origin, depth_seen)
            counts["overrides"] += 1
            counts["override: " + (" + ".join(sorted({c.kind for c in these})) or "restart")] += 1
            found.extend(these)
            return plan

        policy.choose = choose
        run_episode(world, policy, pipeline.drive, pipeline.data.rig)
        print(f"\r{number} episodes driven, {counts['overrides']} overrides in {counts['replans']} replans",
              end="", flush=True)
    print()
    return counts, found


def print_support(found: list[Culprit], field: str = "support", head: str = "segmentation",
                  cuts: tuple = SUPPORT_CUTS) -> None:
    """How many false and true culprits each cut of a head's support would drop, per extent and per class."""
    false = np.array([c.kind == "false positive" for c in found])
    labels = np.array([c.label for c in found])
    for e, extent in enumerate(EXTENTS):
        support = np.array([getattr(c, field)[e] for c in found])
        print(f"{head} support over {extent:g} of the image rectangle (0: the centre cell):")
        for cut in cuts:
            below = support < cut
            per_class = ", ".join(f"{name} {int((below & false & (labels == name)).sum())}/"
                                  f"{int((below & ~false & (labels == name)).sum())}" for name in sorted(set(labels)))
            print(f"   under {cut:g}: drops {int((below & false).sum())} of {int(false.sum())} false positives and "
                  f"{int((below & ~false).sum())} of {int((~false).sum())} true culprits (false/true by class: "
                  f"{per_class})")


def print_rays(found: list[Culprit]) -> None:
    """Where the false positives lie against the road users' camera rays: on a road user's ray (nearer or farther
    than it, and whether that road user was detected as well: a duplicate along the ray) or off every ray."""
    false = [c for c in found if c.kind == "false positive"]
    on_ray = [c for c in false if c.ray is not None and c.ray[0] < RAY_DEGREES]
    print(f"false positives within {RAY_DEGREES:g} degrees of a road user's camera ray: {len(on_ray)} of {len(false)}")
    for name, keep in (("nearer than it", lambda r: r < 1.0), ("farther than it", lambda r: r >= 1.0)):
        these = [c for c in on_ray if keep(c.ray[1])]
        duplicated = sum(c.ray[2] for c in these)
        ratios = np.array([c.ray[1] for c in these])
        print(f"   {name}: {len(these)} (that road user detected too: {duplicated}); range ratio median "
              f"{np.median(ratios) if len(ratios) else float('nan'):.2f}; by class: "
              + ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(c.label for c in these).items())))
    bearings = np.array([c.ray[0] for c in false if c.ray is not None])
    edges = (0.0, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0)
    counts = np.histogram(bearings, bins=edges)[0]
    print("   bearing to the nearest road user's ray, false positives per degree (a peak at 0: placed along a ray; "
          "flat: by chance): " + ", ".join(f"[{a:g}, {b:g}) {n / (b - a):.1f}" for a, b, n in
                                           zip(edges[:-1], edges[1:], counts)))
    for cut in (1.0, 2.0, 3.0, 5.0):
        dropped = [c for c in found if c.shadow_degrees < cut]
        false_dropped = sum(c.kind == "false positive" for c in dropped)
        print(f"   in front of a higher-scoring detection within {cut:g} degrees of its ray: {false_dropped} of "
              f"{len(false)} false positives, {len(dropped) - false_dropped} of {len(found) - len(false)} true ones")
    ranges = np.array([c.range_m for c in false])
    if len(ranges):
        print(f"false positives' range: median {np.median(ranges):.1f} m, quartiles {np.percentile(ranges, 25):.1f} / "
              f"{np.percentile(ranges, 75):.1f} m")


def main() -> None:
    from stack.config import load_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    pipeline = load_pipeline(args.config, ["drive.workers=1", *args.overrides])
    counts, found = overrides(args.checkpoint, pipeline)
    for key, value in sorted(counts.items()):
        print(f"{key:45s} {value}")
    scores = np.array([c.score for c in found])
    false = np.array([c.kind == "false positive" for c in found])
    for low, high in zip(SCORE_BINS[:-1], SCORE_BINS[1:]):
        inside = (scores >= low) & (scores < high)
        if inside.any():
            print(f"culprits scoring [{low:g}, {high:g}): {int(inside.sum())}, "
                  f"false positives {int(false[inside].sum())}")
    print_support(found)
    print_support(found, "depth", "depth", DEPTH_CUTS)
    print_rays(found)
    errors = [c.velocity_error for c in found if c.velocity_error is not None]
    if errors:
        print(f"velocity error of the matched culprits: mean {np.mean(errors):.2f} m/s, median {np.median(errors):.2f}")


if __name__ == "__main__":
    main()
