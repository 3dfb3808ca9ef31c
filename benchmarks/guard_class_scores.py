"""Does the plan guard stop less for false positives if pedestrians and cyclists count only from a higher score?

On the tiny-drive DAgger network's tuning drives most of the detections that alone overrule the planner are false
positives, and most of those are pedestrians and cyclists scoring under 0.25 (`benchmarks/guard_overrides.py`;
docs/log/2026-11-29_class-guard-scores-and-training-length.md). Detectors are often read with a score threshold per
class; this drives `stack drive` with the guard reading the network's detections of the classes named in
GUARD_CLASS_SCORES (JSON, class -> lowest score counted) only at or above their own score, every other class at
`guard.score` as before. Nothing else of the drive changes.

    GUARD_CLASS_SCORES='{"pedestrian": 0.25, "cyclist": 0.25}' python benchmarks/guard_class_scores.py \\
        drive runs/td-dagger-lr1/model.pt -c configs/pipeline.yaml -c configs/presets/tiny.yaml \\
        -c configs/presets/tiny-drive.yaml drive.split=tuning --episodes 112 "drive.seeds=[0,1,2,3,4,5]" \\
        "drive.baselines=[]" drive.latency_ms=71.1 drive.clips=0 drive.out_dir=runs/exp/t112-vru0.25

The policies' worker processes are forked (`stack.sim.drive`), so they decode with the replaced decoder too.
"""

from __future__ import annotations

import json
import os
import sys


def above_class_scores(detected, class_scores: dict[str, float], classes: list[str]):
    """`detected` (`stack.models.decoders.Detections`) without the boxes of a class in `class_scores` scoring under
    that class's score."""
    import torch

    from stack.models.decoders import Detections

    low = torch.zeros(len(detected.scores), dtype=torch.bool)
    for name, score in class_scores.items():
        low |= (detected.labels == classes.index(name)) & (detected.scores < score)
    return Detections(detected.boxes[~low], detected.scores[~low], detected.labels[~low],
                      None if detected.attributes is None else detected.attributes[~low])


def class_scores_from_environment(classes: list[str]) -> dict[str, float]:
    """GUARD_CLASS_SCORES, checked against the network's detection classes."""
    raw = os.environ.get("GUARD_CLASS_SCORES", "")
    try:
        scores = json.loads(raw)
    except json.JSONDecodeError as error:
        sys.exit(f"GUARD_CLASS_SCORES: expected JSON such as '{{\"pedestrian\": 0.25}}', got {raw!r} ({error})")
    unknown = set(scores) - set(classes) if isinstance(scores, dict) else {raw}
    numbers = isinstance(scores, dict) and all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in scores.values())
    if not scores or unknown or not numbers:
        sys.exit(f"GUARD_CLASS_SCORES: expected a JSON object from detection classes ({', '.join(classes)}) to "
                 f"scores in [0, 1], got {raw!r}")
    return {name: float(score) for name, score in scores.items()}


def main() -> int:
    """Read GUARD_CLASS_SCORES once (exit 2 with what to give when it is bad), then run `stack` with the decoder
    that drops the named classes under their scores."""
    from stack.cli import main as stack_main
    from stack.models import decoders
    from stack.pipeline.model_config import DETECTION_CLASSES

    try:
        scores = class_scores_from_environment(list(DETECTION_CLASSES))
    except SystemExit as bad:
        print(bad, file=sys.stderr)
        return 2
    decode = decoders.decode_detections

    def decode_above_class_scores(outputs, pipeline):
        classes = list(pipeline.model.detection_classes)
        return [above_class_scores(detected, scores, classes) for detected in decode(outputs, pipeline)]

    decoders.decode_detections = decode_above_class_scores
    return stack_main(sys.argv[1:])

if __name__ == "__main__":
    sys.exit(main())
