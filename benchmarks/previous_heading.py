"""How well is the ego's heading at the previous key frame known? Three estimates held against the labels.

A temporal network warps the previous key frame's BEV by the ego motion since then (`stack.kinematics.
previous_pose`). The position is the stored past trajectory's last row, exact; the heading is not stored. Between
two consecutive key frames of a sequence, every road user that stands keeps its heading in the world, so the
change of its labelled heading in the ego frame is the ego's own turn: that is the truth here (the median over
the standing road users seen in both frames). Printed per kind of sequence (recorded scenes, closed-loop
episodes, DAgger's): the error of the chord rule `previous_pose` uses (twice the angle of the chord to the previous
position, exact along an arc), of the central difference over the last second, and of the ego status's yaw rate
held over the step (docs/log/2026-11-27_velocity-from-one-frame.md).

    python benchmarks/previous_heading.py -c configs/pipeline.yaml -c configs/presets/tiny.yaml \\
        -c configs/presets/tiny-drive.yaml --split val
"""

from __future__ import annotations

import argparse
import math

import numpy as np

STANDING_MPS = 0.05
STEP_S = 0.5


def labelled_frames(pipeline, split: str) -> list:
    """(key, boxes (A, 10), track ids (A,), past (P, 2), ego status (3,)) of every frame sample of `split`, in order."""
    from stack.data.loader import read_manifest, split_shards
    from stack.data.samples import decode_arrays
    from stack.data.shard_index import SampleReader

    reader, frames = SampleReader(), []
    for shard, _ in split_shards(read_manifest(pipeline.data.root), pipeline.data.root, split):
        for index in range(len(reader.index(shard))):
            sample = reader.read(shard, index)
            arrays = decode_arrays(sample, shard, ("boxes", "box_ids", "past", "ego"))
            frames.append((sample["__key__"], arrays["boxes"], arrays["box_ids"][:, 1], arrays["past"], arrays["ego"]))
    return frames


KINDS = {"s": "recorded scenes", "d": "closed-loop episodes", "i": "DAgger episodes"}


def estimates(frames: list) -> dict:
    """{kind of sequence: (pairs, 4)}: the true previous heading and the chord, central-difference and yaw-rate
    estimates."""
    from stack.data.sequences import previous_key

    rows, by_key = {}, {frame[0]: frame for frame in frames}
    for key, boxes, ids, past, ego in frames:
        before = by_key.get(previous_key(key) or "")
        if before is None:
            continue
        earlier = {int(track): row for track, row in zip(before[2], before[1])}
        turns = [math.remainder(float(row[6] - earlier[int(track)][6]), 2 * math.pi)
                 for track, row in zip(ids, boxes) if int(track) in earlier
                 and np.hypot(*row[7:9]) < STANDING_MPS and np.hypot(*earlier[int(track)][7:9]) < STANDING_MPS]
        if turns:
            chord = 2.0 * math.atan2(-float(past[-1, 1]), -float(past[-1, 0]))
            central = math.atan2(-float(past[-2, 1]), -float(past[-2, 0])) if np.hypot(*past[-2]) > 0.05 else 0.0
            rows.setdefault(KINDS.get(key[0], "other"), []).append(
                (float(np.median(turns)), chord, central, -float(ego[2]) * STEP_S))
    return {kind: np.array(found) for kind, found in rows.items()}


def main() -> None:
    from stack.config import load_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("--split", default="val")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    found = estimates(labelled_frames(load_pipeline(args.config, args.overrides), args.split))
    if not found:
        raise SystemExit("no consecutive key frames with a standing road user seen in both: nothing to measure")
    for kind, pairs in found.items():
        truth = pairs[:, 0]
        print(f"{kind} of the {args.split} split: {len(pairs)} consecutive key-frame pairs; the ego turns by "
              f"{np.median(np.abs(truth)):.4f} rad in a step (median)")
        for column, name in enumerate(("chord rule", "central difference over 1 s", "yaw rate held over the step"), 1):
            error = np.abs(np.remainder(pairs[:, column] - truth + math.pi, 2 * math.pi) - math.pi)
            print(f"  {name:30s} error median {np.median(error):.4f} rad, p90 {np.quantile(error, 0.9):.4f}, "
                  f"max {error.max():.4f}")

if __name__ == "__main__":
    main()
