"""Why does the plan guard overrule the planner? Every override of a drive, held against the ground truth.

Drives a checkpoint with the plan guard (`stack.models.plan_guard`) on a split's episodes and, at every replan
where the guard drives another candidate than the planner's favourite, looks at each detection that rules the
favourite out: a false positive if no road user lies within `MATCH_M` of it; otherwise a true one, which would
still rule the favourite out at the road user's true velocity ("real") or would not ("velocity error"). Prints
the counts, the false-positive share per detection score, and the velocity error of the matched ones
(BENCHMARKS.md, closed loop, "The plan guard across replans"), and for each kind how strongly the network's own
segmentation sees a road user where the culprit lies (`stack.models.plan_guard.segmentation_support`, at the
centre cell and over growing shares of the box's image rectangle): what `model.plan_guard_segmentation` was
chosen from ("Two heads must agree").

    python benchmarks/guard_overrides.py runs/k1-s0/train/model.pt -c configs/pipeline.yaml \\
        -c configs/presets/tiny.yaml -c configs/presets/tiny-drive.yaml model.temporal_frames=1 \\
        model.plan_guard_score=0.2 drive.split=tuning drive.latency_ms=71.1
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
cell, as `model.plan_guard_segmentation` reads it)."""
SUPPORT_CUTS = (0.1, 0.2, 0.3, 0.5)
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


def road_users_in_ego_frame(world) -> np.ndarray:
    """(A, 4) x, y, vx, vy of every other road user now, in the ego frame (velocities over ground)."""
    now, (x, y, yaw) = world.agents_now(), world.ego_state()[:3]
    c, s = math.cos(yaw), math.sin(yaw)
    d = now["boxes"][:, :2] - (x, y)
    heading = now["boxes"][:, 2] - yaw
    return np.stack([d[:, 0] * c + d[:, 1] * s, -d[:, 0] * s + d[:, 1] * c,
                     now["speed"] * np.cos(heading), now["speed"] * np.sin(heading)], axis=1)


def culprits(trajectories, favourite: int, detected, truth: np.ndarray, deceleration: float, support,
             classes) -> list[Culprit]:
    """The detections (`Detections`, with their (M, len(EXTENTS)) segmentation `support`) that alone rule out the
    favourite candidate."""
    from stack.models.plan_guard import colliding_candidates

    found = []
    for box, score, label, seen in zip(detected.boxes, detected.scores.tolist(), detected.labels.tolist(),
                                       support.tolist()):
        if not colliding_candidates(trajectories, box[None], deceleration)[favourite]:
            continue
        distance = np.hypot(truth[:, 0] - float(box[0]), truth[:, 1] - float(box[1])) if len(truth) else np.array([])
        if not len(distance) or distance.min() > MATCH_M:
            found.append(Culprit(score, "false positive", None, tuple(seen), classes[label]))
            continue
        true = truth[int(distance.argmin())]
        corrected = box.clone()
        corrected[7:9] = corrected.new_tensor(true[2:4])
        still = bool(colliding_candidates(trajectories, corrected[None], deceleration)[favourite])
        found.append(Culprit(score, "real" if still else "velocity error",
                             float(np.hypot(*(box[7:9].numpy() - true[2:4]))), tuple(seen), classes[label]))
    return found


def overrides(checkpoint: str, pipeline) -> tuple[collections.Counter, list[Culprit]]:
    """Replans, overrides by the kinds of their culprits, and every culprit of a drive of `pipeline.drive`."""
    import torch

    from stack.deploy.network_policies import checkpoint_spec, road_user_probabilities
    from stack.models.decoders import Detections, decode_detections
    from stack.models.plan_guard import segmentation_support
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
            keep = detected.scores >= model.plan_guard_score
            detected = Detections(detected.boxes[keep], detected.scores[keep], detected.labels[keep])
            things = road_user_probabilities(outputs["seg_logits"], model)
            support = torch.stack([segmentation_support(detected.boxes, things, ks, poses,
                                                        (rig.image_height, rig.image_width), extent)
                                   for extent in EXTENTS], dim=1)
            these = culprits(trajectories, favourite, detected, road_users_in_ego_frame(world),
                             model.plan_guard_deceleration, support, model.detection_classes)
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


def print_support(found: list[Culprit]) -> None:
    """How many false and true culprits each segmentation cut would drop, per extent and per class."""
    false = np.array([c.kind == "false positive" for c in found])
    labels = np.array([c.label for c in found])
    for e, extent in enumerate(EXTENTS):
        support = np.array([c.support[e] for c in found])
        print(f"segmentation support over {extent:g} of the image rectangle (0: the centre cell):")
        for cut in SUPPORT_CUTS:
            below = support < cut
            per_class = ", ".join(f"{name} {int((below & false & (labels == name)).sum())}/"
                                  f"{int((below & ~false & (labels == name)).sum())}" for name in sorted(set(labels)))
            print(f"   under {cut:g}: drops {int((below & false).sum())} of {int(false.sum())} false positives and "
                  f"{int((below & ~false).sum())} of {int((~false).sum())} true culprits (false/true by class: "
                  f"{per_class})")


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
    errors = [c.velocity_error for c in found if c.velocity_error is not None]
    if errors:
        print(f"velocity error of the matched culprits: mean {np.mean(errors):.2f} m/s, median {np.median(errors):.2f}")


if __name__ == "__main__":
    main()
