"""A small multi-task network and learnable synthetic batches with the `stack.models` / `stack.data` contract.

Used by the trainer's tests (and by `run_tiny.py`, which tests start as a separate
program so Lightning can launch DDP/FSDP2 ranks): fast on two CPU cores, with
BatchNorm (to exercise norms under FSDP2 and mixed precision) and a learnable
signal, so losses fall and curves can be compared with a golden file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stack.batch import Batch
from stack.config import load_pipeline

TEST_OVERRIDES = [
    "data.batch_size=2", "data.rig.image_width=64", "data.rig.image_height=32",
    "model.max_boxes=4", "model.planning_steps=4", "model.segmentation_classes=[road,car,sky]",
    "train.accelerator=cpu", "train.precision=32-true", "train.warmup_steps=2", "train.lr=0.01",
    "train.log_every_n_steps=2", "train.max_epochs=1",
    # MLflow costs ~2 s of CPU per process (import, a new store's migrations); tests/train/test_tracking.py turns it on
    "train.tracking_uri=off",
]
"""Overrides that make the default pipeline tiny: 2 samples of 6 cameras at 64x32, untracked."""


STANDIN_RECIPE = ["train.max_epochs=2", "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=4", "train.seed=7"]
"""The stand-in recipe of the trainer's tests: 2 epochs of 6 synthetic batches (12 steps), a checkpoint every 4 steps
(2 kept: 8 and 12), seed 7. tests/train/conftest.py trains it once for the tests that compare with it."""


def tiny_pipeline(*overrides: str):
    return load_pipeline([], [*TEST_OVERRIDES, *overrides])


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class TinyMultiTask(nn.Module):
    """Per-camera conv backbone (two stages) → depth and segmentation heads; pooled features → planner."""

    def __init__(self, pipeline):
        super().__init__()
        classes = len(pipeline.model.segmentation_classes)
        self.steps = pipeline.model.planning_steps
        self.backbone = nn.Sequential(nn.Sequential(_block(3, 16), _block(16, 16)),
                                      nn.Sequential(_block(16, 32), _block(32, 32)))
        self.depth_head = nn.Conv2d(32, 1, 1)
        self.segmentation_head = nn.Conv2d(32, classes, 1)
        self.planning_head = nn.Sequential(nn.Linear(32 + 3, 64), nn.ReLU(), nn.Linear(64, self.steps * 2))

    def forward(self, batch: Batch) -> dict:
        b, n = batch.images.shape[:2]
        x = batch.images.flatten(0, 1).float() / 255.0 - 0.5
        features = self.backbone(x)
        pooled = features.mean(dim=(2, 3)).view(b, n, -1).mean(dim=1)
        plan = self.planning_head(torch.cat([pooled, batch.ego_status], dim=1))
        return {"depth": self.depth_head(features).view(b, n, *features.shape[-2:]),
                "segmentation": self.segmentation_head(features).unflatten(0, (b, n)),
                "trajectory": plan.view(b, self.steps, 2)}

    def loss(self, outputs: dict, batch: Batch) -> dict:
        size = outputs["depth"].shape[-2:]
        depth = F.adaptive_avg_pool2d(batch.depth.float(), size)
        labels = F.interpolate(batch.semantic.float(), size=size, mode="nearest").long()
        seg = outputs["segmentation"]
        terms = {
            "depth": F.l1_loss(outputs["depth"].float(), depth),
            "segmentation": F.cross_entropy(seg.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=255),
            "planning": F.mse_loss(outputs["trajectory"].float(), batch.future_trajectory),
        }
        terms["total"] = sum(terms.values())
        return terms


def synthetic_batch(pipeline, seed: int) -> Batch:
    """A batch whose labels follow from the images: depth and class from brightness, path from speed."""
    rig, model = pipeline.data.rig, pipeline.model
    g = torch.Generator().manual_seed(seed)
    b, n, h, w = pipeline.data.batch_size, len(rig.cameras), rig.image_height, rig.image_width
    m, t, classes = model.max_boxes, model.planning_steps, len(model.segmentation_classes)
    coarse = torch.rand(b, n, 1, h // 8, w // 8, generator=g)
    brightness = F.interpolate(coarse.flatten(0, 1), size=(h, w), mode="nearest").view(b, n, h, w)
    noise = torch.randint(0, 20, (b, n, 3, h, w), generator=g)
    images = (brightness.unsqueeze(2) * 200 + noise).clamp(0, 255).to(torch.uint8)
    speed = torch.rand(b, generator=g) * 10
    steps = torch.arange(1, t + 1).float() * 0.5
    future = torch.stack([speed[:, None] * steps, torch.zeros(b, t)], dim=-1)
    return Batch(
        images=images, intrinsics=torch.eye(3).expand(b, n, 3, 3).contiguous(),
        cam_to_ego=torch.eye(4).expand(b, n, 4, 4).contiguous(),
        depth=(5.0 + 20.0 * brightness).half(), semantic=(brightness * classes).clamp(max=classes - 1).to(torch.uint8),
        boxes=torch.zeros(b, m, 9), box_labels=torch.full((b, m), -1, dtype=torch.long),
        ego_status=torch.stack([speed, torch.zeros(b), torch.zeros(b)], dim=1), command=torch.ones(b, dtype=torch.long),
        past_trajectory=torch.zeros(b, 4, 2), future_trajectory=future, future_valid=torch.ones(b, t, dtype=torch.bool))


def synthetic_loaders(pipeline, batches_per_epoch: int = 6, nan_at: int = -1):
    """(split, rank, world) -> loader: per (epoch, rank) a fixed, different sequence of batches.

    `nan_at` puts a NaN into rank 0's depth labels at that batch index (for the divergence tests).
    """
    from stack.train.datamodule import ResumableLoader

    def make(split: str, rank: int, world: int):
        offset = 0 if split == "train" else 10_000

        def epoch_batches(epoch: int):
            for index in range(batches_per_epoch):
                batch = synthetic_batch(pipeline, offset + (epoch * batches_per_epoch + index) * world + rank)
                if split == "train" and rank == 0 and epoch * batches_per_epoch + index == nan_at:
                    batch.depth[0, 0, 0, 0] = float("nan")
                yield batch
        return ResumableLoader(epoch_batches, batches_per_epoch if split == "train" else 2)
    return make
