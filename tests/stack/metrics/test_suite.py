"""TaskMetrics: decoded network outputs and a Batch in, one flat dict of every task's metrics out."""

import math
import warnings

import pytest
import torch

from stack.config import load_pipeline
from stack.metrics.suite import TaskMetrics
from stack.models import build_model
from stack.models.decoders import decode_all
from stack.synthetic_batch import random_batch


def test_untrained_model_is_scored_on_every_task_with_baselines():
    warnings.filterwarnings("ignore", message="bev_pool: the extension")
    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])
    model = build_model(pipeline).eval()
    metrics = TaskMetrics(pipeline)
    for seed in range(2):
        batch = random_batch(pipeline, batch_size=2, seed=seed)
        with torch.no_grad():
            metrics.update(decode_all(model.forward_batch(batch), pipeline), batch)
    result = metrics.compute()
    for key in ("detection/mAP", "detection/mATE", "segmentation/mIoU", "depth/AbsRel", "planning/L2_at_3s",
                "planning/L2_avg_3s", "planning/collision_at_3s", "planning/minADE",
                "segmentation/baseline_majority/mIoU", "depth/baseline_mean_depth/AbsRel",
                "planning/baseline_cv/L2_at_3s", "planning/baseline_ego_rollout/L2_at_3s",
                "detection/baseline_empty/mAP", "detection/NDS", "detection/mAAE", "detection/mAVE"):
        assert key in result and not math.isnan(result[key]), key
    # the tiny preset's attribute head gives every box an attribute of its class (each class has some), scored
    # against the batch's labels: an untrained head's error is measured, not the devkit's 1 for a missing one
    assert result["detection/predictions_with_attribute"] == result["detection/predictions"] > 0
    assert result["detection/gt_with_attribute"] > 0 and 0.0 <= result["detection/mAAE"] <= 1.0
    assert result["detection/predictions_with_velocity"] == result["detection/predictions"] > 0
    assert result["detection/samples"] == 4 and result["depth/images"] == 4 * len(pipeline.data.rig.cameras)
    # an untrained planner's residuals start at zero: it plans exactly the ego-status rollout
    assert result["planning/L2_at_3s"] == pytest.approx(result["planning/baseline_ego_rollout/L2_at_3s"], abs=1e-4)


def test_merging_shards_equals_evaluating_the_whole_split():
    warnings.filterwarnings("ignore", message="bev_pool: the extension")
    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])
    model = build_model(pipeline).eval()
    whole, shards = TaskMetrics(pipeline), [TaskMetrics(pipeline), TaskMetrics(pipeline)]
    for seed, shard in enumerate(shards):  # as two ranks would see the split
        batch = random_batch(pipeline, batch_size=1, seed=10 + seed)
        with torch.no_grad():
            decoded = decode_all(model.forward_batch(batch), pipeline)
        whole.update(decoded, batch)
        shard.update(decoded, batch)
    shards[0].merge(shards[1])
    merged, expected = shards[0].compute(), whole.compute()
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert (math.isnan(value) and math.isnan(merged[key])) or merged[key] == pytest.approx(value, rel=1e-12), key


def test_depth_on_road_users_pixels_scores_only_the_detected_classes():
    """`stack eval`'s depth line: the error on the pixels of the classes the detector finds (what places a road user
    in the BEV), beside the whole image's. A prediction exact everywhere but twice too far on those pixels has
    AbsRel exactly 1 there and far less over the image."""
    from stack.metrics.depth import summary

    warnings.filterwarnings("ignore", message="bev_pool: the extension")
    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])
    model = build_model(pipeline).eval()
    batch = random_batch(pipeline, batch_size=2, seed=3)
    classes = pipeline.model.segmentation_classes
    batch.semantic[:, :3, 100:120, 30:50] = classes.index("car")  # a car low in three cameras of each sample
    users = torch.isin(batch.semantic.long(), torch.tensor([classes.index(n) for n in pipeline.model.detection_classes]))
    assert users.any() and not users.all()
    with torch.no_grad():
        decoded = decode_all(model.forward_batch(batch), pipeline)
    gt = batch.depth.float()
    decoded["depth"] = torch.where(users, 2 * gt, gt)
    metrics = TaskMetrics(pipeline)
    metrics.update(decoded, batch)
    result = metrics.compute()
    shown = int(((users & (gt > 1e-3) & (gt < pipeline.model.depth.max_m)).flatten(2).any(-1)).sum())
    assert result["depth_road_users/images"] == shown > 0
    assert result["depth_road_users/AbsRel"] == pytest.approx(1.0)
    assert 0 < result["depth/AbsRel"] < 0.5
    assert summary(result).startswith("on road users' pixels AbsRel 1.000")
