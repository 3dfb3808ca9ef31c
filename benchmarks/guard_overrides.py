"""Why does the plan guard overrule the planner? Every override of a drive, held against the ground truth.

Drives a checkpoint with the plan guard (`stack.models.plan_guard`) on a split's episodes and, at every replan
where the guard drives another candidate than the planner's favourite, looks at each detection that rules the
favourite out: a false positive if no road user lies within `MATCH_M` of it; otherwise a true one, which would
still rule the favourite out at the road user's true velocity ("real") or would not ("velocity error"). Prints
the counts, the false-positive share per detection score, and the velocity error of the matched ones
(BENCHMARKS.md, closed loop, "The plan guard across replans").

    python benchmarks/guard_overrides.py runs/k1-s0/train/model.pt -c configs/pipeline.yaml \\
        -c configs/presets/tiny.yaml -c configs/presets/tiny-drive.yaml model.temporal_frames=1 \\
        model.plan_guard_score=0.2 drive.split=tuning drive.latency_ms=71.1
"""

from __future__ import annotations

import argparse
import collections
import math

import numpy as np

MATCH_M = 2.5
"""A detection within this of a road user's centre is that road user (3.5x the tiny-drive network's mATE)."""
SCORE_BINS = (0.0, 0.25, 0.3, 0.4, 0.6, 1.0)


def road_users_in_ego_frame(world) -> np.ndarray:
    """(A, 4) x, y, vx, vy of every other road user now, in the ego frame (velocities over ground)."""
    now, (x, y, yaw) = world.agents_now(), world.ego_state()[:3]
    c, s = math.cos(yaw), math.sin(yaw)
    d = now["boxes"][:, :2] - (x, y)
    heading = now["boxes"][:, 2] - yaw
    return np.stack([d[:, 0] * c + d[:, 1] * s, -d[:, 0] * s + d[:, 1] * c,
                     now["speed"] * np.cos(heading), now["speed"] * np.sin(heading)], axis=1)


def culprits(trajectories, favourite: int, boxes, scores, truth: np.ndarray, deceleration: float) -> list:
    """(score, kind, velocity error m/s or None) of each box (M, 9) that alone rules out the favourite candidate."""
    from stack.models.plan_guard import colliding_candidates

    found = []
    for box, score in zip(boxes, scores):
        if not colliding_candidates(trajectories, box[None], deceleration)[favourite]:
            continue
        distance = np.hypot(truth[:, 0] - float(box[0]), truth[:, 1] - float(box[1])) if len(truth) else np.array([])
        if not len(distance) or distance.min() > MATCH_M:
            found.append((float(score), "false positive", None))
            continue
        true = truth[int(distance.argmin())]
        corrected = box.clone()
        corrected[7:9] = corrected.new_tensor(true[2:4])
        still = bool(colliding_candidates(trajectories, corrected[None], deceleration)[favourite])
        found.append((float(score), "real" if still else "velocity error",
                      float(np.hypot(*(box[7:9].numpy() - true[2:4])))))
    return found


def overrides(checkpoint: str, pipeline) -> tuple[collections.Counter, list]:
    """Replans, overrides by the kinds of their culprits, and every culprit of a drive of `pipeline.drive`."""
    import torch

    from stack.deploy.network_policies import checkpoint_spec
    from stack.models.decoders import decode_detections
    from stack.sim.drive import episodes_of
    from stack.sim.episode import run_episode
    from stack.sim.policies import build_policy
    from stack.sim.scenarios import build_world

    latency = pipeline.drive.latency_ms if pipeline.drive.latency_ms >= 0 else 0.0
    policy = build_policy(checkpoint_spec("checkpoint", checkpoint, latency_s=latency / 1000, latency_how="given"),
                          pipeline)
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
            keep = detected.scores >= pipeline.model.plan_guard_score
            these = culprits(trajectories, favourite, detected.boxes[keep], detected.scores[keep],
                             road_users_in_ego_frame(world), pipeline.model.plan_guard_deceleration)
            counts["overrides"] += 1
            counts["override: " + (" + ".join(sorted({kind for _, kind, _ in these})) or "restart")] += 1
            found.extend(these)
            return plan

        policy.choose = choose
        run_episode(world, policy, pipeline.drive, pipeline.data.rig)
        print(f"\r{number} episodes driven, {counts['overrides']} overrides in {counts['replans']} replans",
              end="", flush=True)
    print()
    return counts, found


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
    scores = np.array([score for score, _, _ in found])
    false = np.array([kind == "false positive" for _, kind, _ in found])
    for low, high in zip(SCORE_BINS[:-1], SCORE_BINS[1:]):
        inside = (scores >= low) & (scores < high)
        if inside.any():
            print(f"culprits scoring [{low:g}, {high:g}): {int(inside.sum())}, "
                  f"false positives {int(false[inside].sum())}")
    errors = [error for _, _, error in found if error is not None]
    if errors:
        print(f"velocity error of the matched culprits: mean {np.mean(errors):.2f} m/s, median {np.median(errors):.2f}")


if __name__ == "__main__":
    main()
