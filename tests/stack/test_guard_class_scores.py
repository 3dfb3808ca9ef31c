"""benchmarks/guard_class_scores.py: the guard reads the named classes only from their own score."""

import pytest
import torch

from stack import bench_only
from stack.models.decoders import Detections

scores_by_class = bench_only.load("guard_class_scores")
pytestmark = pytest.mark.skipif(scores_by_class is None, reason=bench_only.MISSING)
CLASSES = ["car", "truck", "pedestrian", "cyclist"]


def test_only_the_named_classes_under_their_score_are_dropped():
    detected = Detections(torch.arange(45, dtype=torch.float32).reshape(5, 9),
                          torch.tensor([0.9, 0.2, 0.2, 0.3, 0.1]), torch.tensor([2, 2, 0, 3, 3]),
                          torch.tensor([4, 5, 0, 1, 2]))
    kept = scores_by_class.above_class_scores(detected, {"pedestrian": 0.25, "cyclist": 0.25}, CLASSES)
    assert kept.scores.tolist() == pytest.approx([0.9, 0.2, 0.3])  # the car at 0.2 stays: it is not named
    assert kept.labels.tolist() == [2, 0, 3] and kept.attributes.tolist() == [4, 0, 1]
    assert torch.equal(kept.boxes, detected.boxes[[0, 2, 3]])


def test_a_class_the_network_does_not_detect_is_refused(monkeypatch):
    monkeypatch.setenv("GUARD_CLASS_SCORES", '{"bus": 0.3}')
    with pytest.raises(SystemExit, match="detection classes"):
        scores_by_class.class_scores_from_environment(CLASSES)
    monkeypatch.setenv("GUARD_CLASS_SCORES", "pedestrian=0.3")
    with pytest.raises(SystemExit, match="expected JSON"):
        scores_by_class.class_scores_from_environment(CLASSES)
    monkeypatch.setenv("GUARD_CLASS_SCORES", '{"pedestrian": "high"}')
    with pytest.raises(SystemExit, match=r"scores in \[0, 1\]"):
        scores_by_class.class_scores_from_environment(CLASSES)
