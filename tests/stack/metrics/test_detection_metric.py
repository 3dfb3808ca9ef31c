"""nuScenes detection metrics against nuscenes-devkit's own accumulate / calc_ap / calc_tp and, for the full
benchmark (NDS, mAAE, per-class exclusions), its `DetectionEval.evaluate` and `DetectionMetrics.nd_score`."""

import math

import numpy as np
import pytest

from stack.metrics.detection import ATTRIBUTES, DISTANCE_THRESHOLDS, DetectionMetric, class_ranges, summary

# The oracle: nuscenes-devkit (installed with --no-deps, see pyproject's dev extra).
import nuscenes.eval.detection.algo as devkit
from nuscenes.eval.common.config import config_factory
from nuscenes.eval.common.data_classes import EvalBoxes
from nuscenes.eval.common.utils import center_distance
from nuscenes.eval.detection.constants import DETECTION_NAMES
from nuscenes.eval.detection.data_classes import DetectionBox
from nuscenes.eval.detection.evaluate import DetectionEval
from pyquaternion import Quaternion

CLASSES = ["car", "truck", "pedestrian", "bicycle"]  # nuScenes names, so the devkit accepts them


def random_boxes(rng, n, extent=40.0):
    """n BOX_FIELDS rows with centres within +-extent m."""
    return np.column_stack([rng.uniform(-extent, extent, (n, 2)), rng.uniform(0, 2, n), rng.uniform(0.5, 6, (n, 3)),
                            rng.uniform(-math.pi, math.pi, n), rng.normal(0, 3, (n, 2))])


def random_split(rng, samples=12, max_gt=6):
    """GT boxes per sample and noisy predictions near them (misses, duplicates, false positives)."""
    split = []
    for _ in range(samples):
        n = int(rng.integers(0, max_gt + 1))
        gt = random_boxes(rng, n)
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


def devkit_box(token, row, name, score=-1.0, attribute=-1):
    """A BOX_FIELDS row as the devkit's DetectionBox (its size is width, length, height; GT scores -1)."""
    return DetectionBox(sample_token=token, translation=tuple(row[:3]), size=tuple(row[[4, 3, 5]]),
                        rotation=tuple(Quaternion(axis=[0, 0, 1], angle=row[6]).elements), velocity=tuple(row[7:9]),
                        detection_name=name, detection_score=float(score),
                        attribute_name=ATTRIBUTES[attribute] if attribute >= 0 else "")


def to_devkit(split):
    gt_boxes, pred_boxes = EvalBoxes(), EvalBoxes()
    for i, (pred, scores, pred_labels, gt, gt_labels) in enumerate(split):
        token = f"s{i}"
        gt_boxes.add_boxes(token, [devkit_box(token, r, CLASSES[l]) for r, l in zip(gt, gt_labels)])
        pred_boxes.add_boxes(token, [devkit_box(token, r, CLASSES[l], s) for r, l, s in zip(pred, pred_labels, scores)])
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


def test_a_resample_of_merged_frames_scores_as_the_devkit_scores_those_frames():
    """The accuracy gate's bootstrap rescores resamples of frames (repeats included) by merging per-frame
    accumulators whose matches an earlier compute already made: each resample scores as the devkit scores it."""
    rng = np.random.default_rng(11)
    split = random_split(rng, samples=10)
    frames = []
    for pred, scores, labels, gt, gt_labels in split:
        frames.append(DetectionMetric(CLASSES))
        frames[-1].update([pred], [scores], [labels], *padded(gt, gt_labels))
    whole = DetectionMetric(CLASSES)
    for frame in frames:
        whole.merge(frame)
    whole.compute()
    for _ in range(3):
        picked = rng.integers(0, len(split), len(split))
        resample = DetectionMetric(CLASSES)
        for index in picked:
            resample.merge(frames[index])
        mine, theirs = resample.compute(), oracle([split[index] for index in picked])
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, abs=1e-9), key


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


# ---------------------------------------------------------------- the full benchmark: NDS, mAAE, exclusions

CLASS_ATTRIBUTES = {**{name: ("vehicle.moving", "vehicle.parked", "vehicle.stopped")
                       for name in ("car", "truck", "bus", "trailer", "construction_vehicle")},
                    "pedestrian": ("pedestrian.moving", "pedestrian.sitting_lying_down", "pedestrian.standing"),
                    "motorcycle": ("cycle.with_rider", "cycle.without_rider"),
                    "bicycle": ("cycle.with_rider", "cycle.without_rider"), "traffic_cone": (), "barrier": ()}
"""The attributes nuScenes annotates per class (cones and barriers have none)."""
TP_NAMES = {"ATE": "trans_err", "ASE": "scale_err", "AOE": "orient_err", "AVE": "vel_err", "AAE": "attr_err"}


def attribute_of(rng, name):
    """A random attribute index of the class's set, or -1 (a class without attributes)."""
    choices = CLASS_ATTRIBUTES[name]
    return ATTRIBUTES.index(choices[rng.integers(len(choices))]) if choices else -1


def full_split(rng, samples=14, velocity=True, attributes=True, unlabelled=0.05):
    """Boxes of all ten nuScenes classes within 17 m (inside every class range) with GT attributes (a share
    `unlabelled` missing, as some of nuScenes' are) and NaN GT velocities (5%), and noisy predictions (misses,
    confused classes, false positives) with velocities and attributes (right 70% of the time), or without them
    (NaN velocity, attribute -1)."""
    split = []
    for _ in range(samples):
        n = int(rng.integers(0, 9))
        gt, gt_labels = random_boxes(rng, n, extent=17.0), rng.integers(0, len(DETECTION_NAMES), n)
        gt[rng.random(n) < 0.05, 7:9] = np.nan
        gt_attributes = np.array([attribute_of(rng, DETECTION_NAMES[l]) if rng.random() >= unlabelled else -1
                                  for l in gt_labels], dtype=np.int64)
        found = rng.random(n) < 0.8
        pred = np.concatenate([gt[found], random_boxes(rng, int(rng.integers(0, 3)), extent=17.0)])
        pred[:, :2] += rng.normal(0, 0.8, (len(pred), 2))
        pred[:, 3:6] *= rng.uniform(0.7, 1.3, (len(pred), 3))
        pred[:, 6] += rng.normal(0, 0.4, len(pred))
        pred[:, 7:9] = np.nan_to_num(pred[:, 7:9]) + rng.normal(0, 1, (len(pred), 2))
        labels = np.concatenate([gt_labels[found], rng.integers(0, len(DETECTION_NAMES), len(pred) - found.sum())])
        labels = np.where(rng.random(len(pred)) < 0.9, labels, rng.integers(0, len(DETECTION_NAMES), len(pred)))
        truth = np.concatenate([gt_attributes[found], np.full(len(pred) - found.sum(), -1)])
        pred_attributes = np.array([t if t >= 0 and rng.random() < 0.7 else attribute_of(rng, DETECTION_NAMES[l])
                                    for t, l in zip(truth, labels)], dtype=np.int64)
        if not velocity:
            pred[:, 7:9] = np.nan
        if not attributes:
            pred_attributes[:] = -1
        split.append((pred, rng.random(len(pred)), labels, pred_attributes, gt, gt_labels, gt_attributes))
    return split


def devkit_evaluation(split):
    """The devkit's own evaluation of `split`: DetectionMetrics of `DetectionEval.evaluate` with nuScenes' config.
    Its __init__ reads a nuScenes database and filters boxes by range; evaluate() needs only the config and boxes."""
    gt_boxes, pred_boxes = EvalBoxes(), EvalBoxes()
    for i, (pred, scores, labels, attributes, gt, gt_labels, gt_attributes) in enumerate(split):
        token = f"s{i}"
        gt_boxes.add_boxes(token, [devkit_box(token, r, DETECTION_NAMES[l], attribute=a)
                                   for r, l, a in zip(gt, gt_labels, gt_attributes)])
        pred_boxes.add_boxes(token, [devkit_box(token, r, DETECTION_NAMES[l], s, a)
                                     for r, l, a, s in zip(pred, labels, attributes, scores)])
    evaluation = DetectionEval.__new__(DetectionEval)
    evaluation.cfg, evaluation.verbose = config_factory("detection_cvpr_2019"), False
    evaluation.gt_boxes, evaluation.pred_boxes = gt_boxes, pred_boxes
    return evaluation.evaluate()[0]


def full_ours(split):
    metric = DetectionMetric(DETECTION_NAMES, ranges=class_ranges(DETECTION_NAMES))
    for pred, scores, labels, attributes, gt, gt_labels, gt_attributes in split:
        boxes, padded_labels = padded(gt, gt_labels, m=10)
        padded_attributes = np.full((1, 10), -1)
        padded_attributes[0, :len(gt)] = gt_attributes
        metric.update([pred], [scores], [labels], boxes, padded_labels, [attributes], padded_attributes)
    return metric.compute()


def assert_same_as_devkit(mine, theirs):
    assert mine["NDS"] == pytest.approx(theirs.nd_score, abs=1e-9)
    assert mine["mAP"] == pytest.approx(theirs.mean_ap, abs=1e-9)
    for ours_name, name in TP_NAMES.items():
        assert mine[f"m{ours_name}"] == pytest.approx(theirs.tp_errors[name], abs=1e-9), ours_name
        for detection_name in DETECTION_NAMES:
            expected = theirs.get_label_tp(detection_name, name)
            assert mine[f"{ours_name}_{detection_name}"] == pytest.approx(expected, abs=1e-9, nan_ok=True), \
                (ours_name, detection_name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nds_and_every_tp_error_match_the_devkits_evaluation(seed):
    split = full_split(np.random.default_rng(seed))
    mine, theirs = full_ours(split), devkit_evaluation(split)
    assert_same_as_devkit(mine, theirs)
    assert 0 < mine["mAAE"] < 1 and 0 < mine["mAVE"] and 0 < mine["NDS"] < 1
    # the exclusions: a cone scores no orientation, velocity or attribute; a barrier no velocity or attribute
    assert all(np.isnan(mine[f"{e}_traffic_cone"]) for e in ("AOE", "AVE", "AAE"))
    assert all(np.isnan(mine[f"{e}_barrier"]) for e in ("AVE", "AAE")) and not np.isnan(mine["AOE_barrier"])


def test_a_barrier_turned_around_keeps_its_orientation():
    """A barrier's heading is defined up to pi (devkit `accumulate`): a box turned by pi has no AOE; a car does."""
    gt = np.array([[5.0, 5.0, 0.5, 2.0, 0.5, 1.0, 0.3, 0.0, 0.0]])
    turned = gt.copy()
    turned[0, 6] += np.pi
    for name, expected in (("barrier", 0.0), ("car", np.pi)):
        label = DETECTION_NAMES.index(name)
        split = [(turned, np.array([0.9]), np.array([label]), np.array([-1]), gt, np.array([label]), np.array([-1]))]
        assert full_ours(split)[f"AOE_{name}"] == pytest.approx(expected, abs=1e-9)
        assert devkit_evaluation(split).get_label_tp(name, "orient_err") == pytest.approx(expected, abs=1e-9)


def test_without_velocity_or_attribute_predictions_both_score_the_worst_value():
    """NaN velocities and no attributes are what the devkit would be given by a network without those heads: it
    scores mAVE = mAAE = 1 (every velocity error undefined, every labelled attribute wrong), so NDS loses their
    0.2 instead of being flattered."""
    split = full_split(np.random.default_rng(3), velocity=False, attributes=False, unlabelled=0.0)
    mine, theirs = full_ours(split), devkit_evaluation(split)
    assert_same_as_devkit(mine, theirs)
    assert mine["mAVE"] == 1.0 and mine["mAAE"] == 1.0
    with_heads = full_ours(full_split(np.random.default_rng(3), unlabelled=0.0))
    assert with_heads["mAP"] == pytest.approx(mine["mAP"])
    assert mine["NDS"] < with_heads["NDS"]
    assert mine["predictions"] > 0 and mine["predictions_with_velocity"] == mine["predictions_with_attribute"] == 0
    line = summary({f"detection/{key}": value for key, value in mine.items()})
    assert line.startswith(f"NDS {mine['NDS']:.3f}") and "no velocity head" in line and "no attribute head" in line
    assert "no " not in summary({f"detection/{key}": value for key, value in with_heads.items()})
    assert "no attribute labels" in summary({"detection/gt_boxes": 3.0, "detection/gt_with_attribute": 0.0})


def test_nds_is_the_weighted_sum_of_map_and_clipped_tp_scores():
    """NDS = (5 mAP + sum over the five TP errors of (1 - min(1, error))) / 10; the empty detector scores 0."""
    split = full_split(np.random.default_rng(4))
    result = full_ours(split)
    scores = [1 - min(1.0, result[f"m{e}"]) for e in TP_NAMES]
    assert result["NDS"] == pytest.approx((5 * result["mAP"] + sum(scores)) / 10)
    empty = [(np.zeros((0, 9)), np.zeros(0), np.zeros(0, int), np.zeros(0, int), *rest) for *_, gt, l, a in split
             for rest in [(gt, l, a)]]
    nothing = full_ours(empty)
    assert nothing["NDS"] == 0.0 == nothing["baseline_empty/NDS"] and nothing["mAAE"] == 1.0
    assert devkit_evaluation(empty).nd_score == 0.0


def test_matches_before_the_first_defined_error_count_zero_as_in_the_devkit():
    """The devkit's running mean of an error skips undefined matches but counts those ranked before the first
    defined one as 0 (`cummean`'s `out=zeros`), so a network without attributes scores mAAE just under 1 when the
    most confident matches have unlabelled GT. Reproduced, not corrected: the figure must be the devkit's."""
    split = full_split(np.random.default_rng(3), attributes=False)
    mine, theirs = full_ours(split), devkit_evaluation(split)
    assert_same_as_devkit(mine, theirs)
    assert 0.5 < mine["mAAE"] < 1.0
