"""What do the training labels say when the ego stands? The inertia problem, counted.

Behaviour cloning learns "stopped means stay stopped" when most standing frames of its data stay standing
(Codevilla et al., ICCV 2019, "Exploring the limitations of behavior cloning for autonomous driving"). For every
training frame of a pipeline's data (no augmentation, in order) with the ego under `STANDING_SPEED`, this counts
whether the expert's label moves on (its 3-s waypoint more than `MOVES_ON_M` ahead), overall and where nothing
stands in the ego's lane within `CLEAR_AHEAD_M` (docs/log/2026-11-27_standstill-labels.md).

    python benchmarks/standstill_labels.py -c configs/pipeline.yaml -c configs/presets/tiny.yaml \\
        -c configs/presets/tiny-drive.yaml
"""

from __future__ import annotations

import argparse

import numpy as np

STANDING_SPEED = 0.5
MOVES_ON_M = 1.0
CLEAR_AHEAD_M = 15.0
LANE_HALF_WIDTH = 2.5
HORIZON_INDEX = 5
"""future_trajectory index of the 3-s waypoint (0.5 s steps)."""


def lane_is_clear(boxes: np.ndarray) -> bool:
    """No box (`Batch.boxes` rows; zero rows are padding) in the ego's lane within CLEAR_AHEAD_M ahead."""
    valid = np.abs(boxes).sum(1) > 0
    return not (valid & (boxes[:, 0] > 0) & (boxes[:, 0] < CLEAR_AHEAD_M) & (np.abs(boxes[:, 1]) < LANE_HALF_WIDTH)).any()


def counts(pipeline) -> dict:
    from stack.data.loader import build_loader

    found = {"frames": 0, "standing": 0, "moves_on": 0, "clear": 0, "clear_moves_on": 0}
    for batch in build_loader(pipeline, "train", shuffle=False, augment=False):
        speeds, plans, valid = batch.ego_status[:, 0].numpy(), batch.future_trajectory.numpy(), batch.future_valid.numpy()
        for i, speed in enumerate(speeds):
            found["frames"] += 1
            if speed >= STANDING_SPEED or not valid[i, HORIZON_INDEX]:
                continue
            moves_on = bool(plans[i, HORIZON_INDEX, 0] > MOVES_ON_M)
            clear = lane_is_clear(batch.boxes[i].numpy())
            found["standing"] += 1
            found["moves_on"] += moves_on
            found["clear"] += clear
            found["clear_moves_on"] += clear and moves_on
    return found


def main() -> None:
    from stack.config import load_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    c = counts(load_pipeline(args.config, args.overrides))
    print(f"{c['frames']} training frames; the ego stands (< {STANDING_SPEED:g} m/s) in {c['standing']}; the expert "
          f"moves on (> {MOVES_ON_M:g} m in 3 s) in {c['moves_on']} of them")
    print(f"standing with the lane clear for {CLEAR_AHEAD_M:g} m: {c['clear']}; the expert moves on in "
          f"{c['clear_moves_on']} of them")


if __name__ == "__main__":
    main()
