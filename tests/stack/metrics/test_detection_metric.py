"""nuScenes detection metrics against nuscenes-devkit's own accumulate / calc_ap / calc_tp."""

import math

import numpy as np
import pytest

from stack.metrics.detection import DISTANCE_THRESHOLDS, DetectionMetric, class_ranges

# The oracle: nuscenes-devkit (installed with --no-deps, see pyproject's dev extra).
import nuscenes.eval.detection.algo as devkit
from nuscenes.eval.common.data_classes import EvalBoxes
from nuscenes.eval.common.utils import center_distance
from nuscenes.eval.detection.data_classes import DetectionBox
from pyquaternion import Quaternion

CLASSES = ["car", "truck", "pedestrian", "bicycle"]  # nuScenes names, so the devkit accepts them


def random_split(rng, samples=12, max_gt=6):
    """GT boxes per sample and noisy predictions near them (misses, duplicates, false positives)."""
    split = []
    for _ in range(samples):
        n = int(rng.integers(0, max_gt + 1))
        gt = np.column_stack([rng.uniform(-40, 40, (n, 2)), rng.uniform(0, 2, n), rng.uniform(0.5, 6, (n, 3)),
                              rng.uniform(-math.pi, math.pi, n), rng.normal(0, 3, (n, 2))])
        gt_labels = rng.integers(0, len(CLASSES), n)
        keep = rng.random(n) < 0.8
        pred = gt[keep].copy()
        pred[:, :2] += rng.normal(0, 1.2, (len(pred), 2))
        pred[:, 3:6] *= rng.uniform(0.7, 1.3, (len(pred), 3))
        pred[:, 6] += rng.normal(0, 0.5, len(pred))
        pred[:, 7:9] += rng.normal(0, 1, (len(pred), 2))
        pred_labels = np.where(rng.random(len(pred)) < 0.9, gt_labels[keep], rng.integers(0, 4, len(pred)))
        extra = int(rng.integers(0, 3))
        fp = np.column_stack([rng.uniform(-40, 40, (extra, 2)), np.ones(extra), rng.uniform(0.5, 6, (extra, 3)),
                              np.zeros((extra, 3))])
        pred = np.concatenate([pred, fp])
        pred_labels = np.concatenate([pred_labels, rng.integers(0, 4, extra)])
        split.append((pred, rng.random(len(pred)), pred_labels, gt, gt_labels))
    return split


def padded(gt, labels, m=8):
    boxes, out = np.zeros((1, m, 9)), np.full((1, m), -1)
    boxes[0, :len(gt)], out[0, :len(gt)] = gt, labels
    return boxes, out


def to_devkit(split):
    gt_boxes, pred_boxes = EvalBoxes(), EvalBoxes()

    def box(token, row, label, score=-1.0):
        return DetectionBox(sample_token=token, translation=tuple(row[:3]), size=tuple(row[[4, 3, 5]]),
                            rotation=tuple(Quaternion(axis=[0, 0, 1], angle=row[6]).elements),
                            velocity=tuple(row[7:9]), detection_name=CLASSES[label], detection_score=float(score))

    for i, (pred, scores, pred_labels, gt, gt_labels) in enumerate(split):
        token = f"s{i}"
        gt_boxes.add_boxes(token, [box(token, r, l) for r, l in zip(gt, gt_labels)])
        pred_boxes.add_boxes(token, [box(token, r, l, s) for r, l, s in zip(pred, pred_labels, scores)])
    return gt_boxes, pred_boxes


def ours(split):
    metric = DetectionMetric(CLASSES)
    for pred, scores, pred_labels, gt, gt_labels in split:
        metric.update([pred], [scores], [pred_labels], *padded(gt, gt_labels))
    return metric.compute()


def oracle(split):
    gt_boxes, pred_boxes = to_devkit(split)
    out = {}
    for name in CLASSES:
        aps = []
        for threshold in DISTANCE_THRESHOLDS:
            md = devkit.accumulate(gt_boxes, pred_boxes, name, center_distance, threshold)
            aps.append(devkit.calc_ap(md, 0.1, 0.1))
        out[f"AP_{name}"] = float(np.mean(aps))
        md = devkit.accumulate(gt_boxes, pred_boxes, name, center_distance, 2.0)
        for ours_name, theirs in (("ATE", "trans_err"), ("ASE", "scale_err"), ("AOE", "orient_err"), ("AVE", "vel_err")):
            out[f"{ours_name}_{name}"] = devkit.calc_tp(md, 0.1, theirs)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_nuscenes_devkit(seed):
    split = random_split(np.random.default_rng(seed))
    mine, theirs = ours(split), oracle(split)
    for key, value in theirs.items():
        assert mine[key] == pytest.approx(value, abs=1e-9), key
    assert mine["mAP"] == pytest.approx(np.mean([theirs[f"AP_{c}"] for c in CLASSES]))
    assert 0 < mine["mAP"] < 1


def test_perfect_predictions_score_one_and_zero_error():
    split = random_split(np.random.default_rng(5), samples=6)
    perfect = [(gt, np.linspace(1, 0.5, len(gt)), gt_labels, gt, gt_labels) for *_, gt, gt_labels in split]
    result = ours(perfect)
    present = {CLASSES[label] for *_, labels in perfect for label in labels}
    for name in present:
        assert result[f"AP_{name}"] == pytest.approx(1.0)
        assert result[f"ATE_{name}"] == pytest.approx(0.0, abs=1e-12)


def test_edge_cases_no_gt_and_no_predictions():
    empty = np.zeros((0, 9))
    metric = DetectionMetric(CLASSES)
    metric.update([empty], [np.zeros(0)], [np.zeros(0, int)], np.zeros((1, 4, 9)), np.full((1, 4), -1))
    result = metric.compute()
    assert result["mAP"] == 0.0 and result["mATE"] == 1.0 and result["gt_boxes"] == 0
    split = random_split(np.random.default_rng(7), samples=4)
    no_predictions = [(empty, np.zeros(0), np.zeros(0, int), gt, labels) for *_, gt, labels in split]
    result = ours(no_predictions)
    assert result["mAP"] == 0.0 and all(result[f"m{e}"] == 1.0 for e in ("ATE", "ASE", "AOE", "AVE"))
    gt_boxes, pred_boxes = to_devkit(no_predictions)
    md = devkit.accumulate(gt_boxes, pred_boxes, "car", center_distance, 2.0)
    assert devkit.calc_ap(md, 0.1, 0.1) == result["AP_car"]
    assert result["baseline_empty/mAP"] == 0.0 and result["baseline_empty/mATE"] == 1.0


def test_boxes_beyond_their_class_range_are_not_scored():
    """As the devkit's filter_eval_boxes: far GT cannot lower recall, far false positives cannot lower precision."""
    def box(x, y):
        return np.array([x, y, 0.0, 4.5, 1.9, 1.6, 0.0, 0.0, 0.0])

    near_gt, far_gt = box(10.0, 5.0), box(60.0, 0.0)      # car range: 50 m
    near_ped_fp = box(0.0, 45.0)                            # pedestrian range: 40 m
    gt = np.stack([near_gt, far_gt, box(0.0, 0.0)])[None]
    gt_labels = np.array([[0, 0, -1]])
    predictions = ([np.stack([near_gt, near_ped_fp, box(70.0, 70.0)])], [np.array([0.9, 0.95, 0.99])],
                   [np.array([0, 2, 0])])
    ranged = DetectionMetric(CLASSES, ranges=class_ranges(CLASSES))
    ranged.update(*predictions, gt, gt_labels)
    assert ranged.compute()["AP_car"] == pytest.approx(1.0)
    unranged = DetectionMetric(CLASSES)
    unranged.update(*predictions, gt, gt_labels)
    assert unranged.compute()["AP_car"] < 0.6  # half the cars missed, a confident false positive ranked first
    assert class_ranges(["car", "pedestrian", "robot"], limit=45.0) == [45.0, 40.0, 45.0]
