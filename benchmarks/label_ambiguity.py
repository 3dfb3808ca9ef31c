"""Can one frame tell whether the expert brakes for the car ahead? The training labels, binned.

For every training frame of a pipeline's data (no augmentation, in order) with the ego faster than
`MIN_EGO_SPEED`, the nearest car in the ego's lane ahead (|y| < `LANE_HALF_WIDTH`) is binned by its distance
and by its own speed (stopped below `STOPPED_SPEED`), and the expert's label is read as the constant
deceleration that fits its 3-s distance at the ego's speed. A one-frame network sees the car's distance but not
its speed: where the label depends on the speed, it can only learn the average
(docs/log/2026-11-26_stopped-vs-lead-car-labels.md).

    python benchmarks/label_ambiguity.py -c configs/pipeline.yaml -c configs/presets/tiny.yaml \\
        -c configs/presets/tiny-drive.yaml
"""

from __future__ import annotations

import argparse

import numpy as np

MIN_EGO_SPEED = 4.0
LANE_HALF_WIDTH = 2.0
STOPPED_SPEED = 1.0
BRAKING = 1.0
"""m/s^2 of deceleration over the 3-s label that counts as braking."""
BINS = ((5, 15), (15, 25), (25, 35), (35, 45))
HORIZON_INDEX = 5
"""future_trajectory index of the 3-s waypoint (0.5 s steps)."""


def nearest_car_ahead(boxes: np.ndarray) -> int | None:
    """Index of the nearest box ahead in the ego's lane, or None (`Batch.boxes` rows, zero rows are padding)."""
    valid = np.abs(boxes).sum(1) > 0
    ahead = valid & (boxes[:, 0] > BINS[0][0] - 1) & (boxes[:, 0] < BINS[-1][1]) & (np.abs(boxes[:, 1]) < LANE_HALF_WIDTH)
    return int(np.argmin(np.where(ahead, boxes[:, 0], np.inf))) if ahead.any() else None


def rows_of(pipeline) -> np.ndarray:
    """(distance, its speed, ego speed, label deceleration) per qualifying training frame."""
    from stack.data.loader import build_loader

    rows = []
    for batch in build_loader(pipeline, "train", shuffle=False, augment=False):
        speeds, plans, valid = batch.ego_status[:, 0].numpy(), batch.future_trajectory.numpy(), batch.future_valid.numpy()
        for i, speed in enumerate(speeds):
            boxes = batch.boxes[i].numpy()
            j = nearest_car_ahead(boxes)
            if j is None or speed <= MIN_EGO_SPEED or not valid[i, HORIZON_INDEX]:
                continue
            seconds = 0.5 * (HORIZON_INDEX + 1)
            deceleration = 2 * (speed * seconds - plans[i, HORIZON_INDEX, 0]) / seconds ** 2
            rows.append((boxes[j, 0], float(np.hypot(boxes[j, 7], boxes[j, 8])), speed, deceleration))
    return np.array(rows).reshape(-1, 4)


def table(rows: np.ndarray) -> str:
    lines = ["| car ahead at | stopped: frames, expert brakes | moving: frames, expert brakes |", "|---|---|---|"]
    for low, high in BINS:
        here = rows[(rows[:, 0] >= low) & (rows[:, 0] < high)]
        cells = []
        for part in (here[here[:, 1] < STOPPED_SPEED], here[here[:, 1] >= STOPPED_SPEED]):
            cells.append(f"{len(part)}, {np.mean(part[:, 3] > BRAKING):.0%} (mean {np.mean(part[:, 3]):.2f} m/s^2)"
                         if len(part) else "0")
        lines.append(f"| {low}-{high} m | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    from stack.config import load_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = rows_of(load_pipeline(args.config, args.overrides))
    print(f"{len(rows)} training frames at > {MIN_EGO_SPEED:g} m/s with a car in the lane ahead")
    print(table(rows))


if __name__ == "__main__":
    main()
