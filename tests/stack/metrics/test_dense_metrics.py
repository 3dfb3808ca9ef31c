"""Segmentation mIoU against torchmetrics; depth errors against hand-computed monodepth2 cases."""

import math

import pytest
import torch
from torchmetrics.classification import MulticlassJaccardIndex

from stack.metrics.depth import DepthMetric
from stack.metrics.segmentation import SegmentationMetric

CLASSES = ["road", "car", "sky", "building", "person"]


@pytest.mark.parametrize("seed", [0, 1])
def test_miou_matches_torchmetrics_over_batches(seed):
    generator = torch.Generator().manual_seed(seed)
    ours = SegmentationMetric(CLASSES)
    oracle = MulticlassJaccardIndex(num_classes=len(CLASSES), average="macro", ignore_index=255)
    oracle_per_class = MulticlassJaccardIndex(num_classes=len(CLASSES), average="none", ignore_index=255)
    for _ in range(3):
        target = torch.randint(0, 4, (2, 3, 16, 24), generator=generator)  # class 4 never in GT
        prediction = torch.where(torch.rand(target.shape, generator=generator) < 0.7, target,
                                 torch.randint(0, 4, target.shape, generator=generator))  # nor predicted
        target[torch.rand(target.shape, generator=generator) < 0.1] = 255
        ours.update(prediction, target)
        oracle.update(prediction.flatten(), target.flatten())
        oracle_per_class.update(prediction.flatten(), target.flatten())
    result = ours.compute()
    assert result["mIoU"] == pytest.approx(float(oracle.compute()), abs=1e-6)
    for i, name in enumerate(CLASSES[:4]):
        assert result[f"IoU_{name}"] == pytest.approx(float(oracle_per_class.compute()[i]), abs=1e-6)
    assert math.isnan(result["IoU_person"])  # absent everywhere: excluded from the mean, as torchmetrics does


def test_majority_baseline_and_edge_cases():
    target = torch.tensor([[0, 0, 0, 1, 2, 255]])
    metric = SegmentationMetric(CLASSES)
    metric.update(target.clamp(max=4), target)
    result = metric.compute()
    assert result["mIoU"] == 1.0 and result["pixels"] == 5
    # always "road": IoU_road = 3/5, car and sky 0 → mIoU over the three present classes = 0.2
    assert result["baseline_majority/mIoU"] == pytest.approx(0.2)
    ignored = SegmentationMetric(CLASSES)
    ignored.update(torch.zeros(4, 4, dtype=torch.long), torch.full((4, 4), 255))
    out = ignored.compute()
    assert out["pixels"] == 0 and math.isnan(out["mIoU"]) and math.isnan(out["baseline_majority/mIoU"])
    oracle = MulticlassJaccardIndex(num_classes=len(CLASSES), average="macro", ignore_index=255)
    assert math.isnan(float(oracle(torch.zeros(16, dtype=torch.long), torch.full((16,), 255))))
    with pytest.raises(ValueError, match="class indices"):
        ignored.update(torch.full((2,), 7), torch.zeros(2, dtype=torch.long))


def test_depth_errors_on_a_hand_computed_image():
    gt = torch.tensor([[2.0, 4.0, 0.0], [10.0, 100.0, 5.0]])  # 0: no depth; 100: above the cap
    pred = torch.tensor([[1.0, 5.0, 3.0], [10.0, 50.0, 200.0]])  # 200 is clamped to the cap 80
    metric = DepthMetric(min_depth=1e-3, max_depth=80.0)
    metric.update(pred[None], gt[None])
    r = metric.compute()
    g, p = [2.0, 4.0, 10.0, 5.0], [1.0, 5.0, 10.0, 80.0]
    assert r["AbsRel"] == pytest.approx((1 / 2 + 1 / 4 + 0 + 75 / 5) / 4)
    assert r["SqRel"] == pytest.approx((1 / 2 + 1 / 4 + 0 + 75**2 / 5) / 4)
    assert r["RMSE"] == pytest.approx(math.sqrt((1 + 1 + 0 + 75**2) / 4))
    assert r["RMSE_log"] == pytest.approx(math.sqrt(sum((math.log(a) - math.log(b)) ** 2 for a, b in zip(g, p)) / 4))
    # ratios 2, 1.25, 1, 16: below 1.25 only 1; below 1.5625: 1.25 and 1; below 1.953: the same two
    assert (r["delta1"], r["delta2"], r["delta3"]) == pytest.approx((0.25, 0.5, 0.5))
    mean = sum(g) / 4
    assert r["baseline_mean_depth/AbsRel"] == pytest.approx(sum(abs(a - mean) / a for a in g) / 4)
    assert r["images"] == 1 and r["max_depth"] == 80.0


def test_depth_averages_over_images_and_skips_images_without_depth():
    metric = DepthMetric(max_depth=50.0)
    gt = torch.tensor([[[10.0, 10.0]], [[20.0, 0.0]], [[0.0, 0.0]]])
    pred = torch.tensor([[[11.0, 9.0]], [[30.0, 5.0]], [[1.0, 1.0]]])
    metric.update(pred, gt)
    r = metric.compute()
    assert r["AbsRel"] == pytest.approx((0.1 + 0.5) / 2)  # per image, then the mean over images
    assert r["images"] == 2 and r["images_without_valid_depth"] == 1
    perfect = DepthMetric()
    perfect.update(gt[:1], gt[:1])
    assert perfect.compute()["AbsRel"] == 0 and perfect.compute()["delta1"] == 1
    nothing = DepthMetric()
    nothing.update(torch.ones(1, 2, 2), torch.zeros(1, 2, 2))
    assert math.isnan(nothing.compute()["RMSE"])
