"""Image backbone (timm, `features_only`) and an FPN neck down to the lifted stride.

The backbone is any timm model that supports `features_only=True` (ResNets,
RegNets, EfficientNets, ConvNeXts ...); no weights are downloaded. A local
checkpoint (`model.backbone_checkpoint`) is loaded by timm itself through
`pretrained_cfg_overlay=dict(file=...)`, which drops the classifier and remaps keys.

The neck is a feature pyramid (Lin et al., arXiv:1612.03144): lateral 1x1 convs,
a top-down path, and a 3x3 smoothing conv at the two strides the heads use — the
segmentation stride and the stride whose features are lifted into BEV.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stack.checkpoint.model_file import read_weights_file
from stack.errors import StackError
from stack.models.layers import ConvNormAct

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def create_backbone(name: str, checkpoint: str | None, min_stride: int) -> nn.Module:
    """timm feature extractor returning every level whose stride is >= `min_stride`."""
    import timm

    if name not in timm.list_models():
        near = timm.list_models(f"*{name.split('_')[0]}*")[:8]
        raise StackError(f"model.backbone: timm has no model {name!r}; similar names: {', '.join(near) or 'none'}. "
                         "Set model.backbone to a timm model name (e.g. resnet18, resnet10t, resnet50).")
    probe = timm.create_model(name, features_only=True, pretrained=False)
    reductions = probe.feature_info.reduction()
    indices = tuple(i for i, r in enumerate(reductions) if r >= min_stride)
    if not indices or max(reductions) < min_stride:
        raise StackError(f"model.backbone {name!r} gives strides {reductions}; the heads need stride {min_stride}. "
                         "Lower model.feature_stride / model.segmentation_stride or pick a deeper backbone.")
    if checkpoint is None:
        return timm.create_model(name, features_only=True, pretrained=False, out_indices=indices)
    if not Path(checkpoint).is_file():
        raise StackError(f"model.backbone_checkpoint {checkpoint!r} does not exist. Give the path of a local "
                         f"{name} state dict (.pth/.safetensors), or set it to null to train from scratch.")
    weights = read_weights_file(checkpoint, "model.backbone_checkpoint", f"a {name} state dict")
    _check_checkpoint_fits(name, checkpoint, weights)
    # the weights already read are handed over: timm would read the file again with its own loader
    return timm.create_model(name, features_only=True, pretrained=True, out_indices=indices,
                             pretrained_cfg_overlay=dict(state_dict=weights))


def _check_checkpoint_fits(name: str, checkpoint: str, weights: dict, min_share: float = 0.9) -> None:
    """Refuse a checkpoint of another architecture: timm loads non-strictly and would only log a warning,
    leaving a silently randomly initialised backbone."""
    import timm

    expected = {key for key in timm.create_model(name, pretrained=False).state_dict()
                if not key.startswith(("fc.", "head", "classifier"))}
    found = set(weights)
    missing = sorted(expected - found)
    if len(missing) > (1 - min_share) * len(expected):
        raise StackError(f"model.backbone_checkpoint {checkpoint!r} does not fit model.backbone {name!r}: "
                         f"{len(missing)} of its {len(expected)} weights are absent (e.g. {', '.join(missing[:3])}). "
                         f"Give a {name} state dict, or set model.backbone to the checkpoint's architecture.")


class FeaturePyramid(nn.Module):
    """Top-down FPN over the backbone levels; returns features at `fine_stride` and `lift_stride`."""

    def __init__(self, in_channels: list[int], strides: list[int], channels: int, fine_stride: int, lift_stride: int):
        super().__init__()
        self.strides = list(strides)
        self.fine_index = self.strides.index(fine_stride)
        self.lift_index = self.strides.index(lift_stride)
        self.lateral = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in in_channels)
        self.smooth_fine = ConvNormAct(channels, channels)
        self.smooth_lift = ConvNormAct(channels, channels) if lift_stride != fine_stride else nn.Identity()

    def forward(self, levels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        top = self.lateral[-1](levels[-1])
        merged = [top]
        for index in range(len(levels) - 2, self.fine_index - 1, -1):
            lateral = self.lateral[index](levels[index])
            top = lateral + F.interpolate(top, size=lateral.shape[-2:], mode="nearest")
            merged.insert(0, top)
        fine = self.smooth_fine(merged[0])
        lift = self.smooth_lift(merged[self.lift_index - self.fine_index])
        return fine, lift


class ImageEncoder(nn.Module):
    """uint8/float images (B*N, 3, H, W) → (fine features, lift features), ImageNet-normalised inside.

    The normalised images enter the backbone channels-last (NHWC strides, same shape): a convolution whose input is
    channels-last runs oneDNN's and cuDNN's NHWC kernels and keeps its output NHWC, so the whole backbone and neck
    skip the layout reorders NCHW costs (PyTorch's channels-last guide; cuDNN's tensor-core convolutions are NHWC).
    `stack bench train-step` measures it against NCHW side by side (docs/results/training.md). The weights keep
    their layout, so checkpoints, DDP/FSDP2 sharding and ONNX export (which has no memory format) are unchanged.
    """

    channels_last = True
    """Whether images enter the backbone channels-last (the bench's NCHW case sets it False on its instance)."""

    def __init__(self, name: str, checkpoint: str | None, channels: int, fine_stride: int, lift_stride: int):
        super().__init__()
        self.backbone = create_backbone(name, checkpoint, fine_stride)
        strides = self.backbone.feature_info.reduction()
        missing = [s for s in (fine_stride, lift_stride) if s not in strides]
        if missing:
            raise StackError(f"model.backbone {name!r} has feature strides {strides}, not {missing}. "
                             "Choose model.feature_stride / model.segmentation_stride from those strides.")
        self.neck = FeaturePyramid(self.backbone.feature_info.channels(), strides, channels, fine_stride, lift_stride)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255.0, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255.0, persistent=False)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (images.float() - self.mean) / self.std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.neck(self.backbone(x))
