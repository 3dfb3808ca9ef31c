"""A small two-headed network that stands in for the real model in deploy tests.

conv+bn+relu stem, two residual blocks, a `segmentation` head (per-pixel logits)
and a `speed` head (a regression from pooled features and an ego input), named
outputs, and a module called `bev_pool` whose nodes must stay fp32. `outlier=True`
plants one layer whose activations span a huge range: per-tensor INT8 destroys it,
so the accuracy gate has to find it and keep it in fp32.
"""

import numpy as np
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, channels: int, scale: float = 1.0):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.scale = scale

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class Outlier(nn.Module):
    """1x1 conv whose first output channel is 1000x the others, scaled back by the next 1x1 conv's weights.

    The activation between the two convs is an input of a weighted layer, which every INT8 placement
    (TensorRT's and ONNX Runtime's) quantizes per tensor: its scale follows the loud channel and
    rounds the other channels to a few levels."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.mix = nn.Conv2d(channels, channels, 1, bias=False)
        with torch.no_grad():
            self.conv.weight[0] *= 1000.0
            self.conv.bias[0] = 0.0
            self.mix.weight.copy_(torch.eye(channels)[:, :, None, None])
            self.mix.weight[:, 0] *= 1e-3

    def forward(self, x):
        return self.mix(self.conv(x))


class BevPool(nn.Module):
    """Stands in for the fixed-geometry BEV pooling: a MatMul by a constant table."""

    def __init__(self, pixels: int):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.register_buffer("table", torch.rand(pixels, pixels, generator=generator) / pixels)

    def forward(self, x):
        b, c, h, w = x.shape
        return torch.matmul(x.reshape(b, c, h * w), self.table).reshape(b, c, h, w)


class Slow(nn.Module):
    """About 5 GFLOP of extra convolutions at 4x the resolution: made far too slow on purpose."""

    def __init__(self, channels: int, wide: int = 128, depth: int = 4, upscale: int = 4):
        super().__init__()
        layers = [nn.Conv2d(channels, wide, 3, padding=1), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Conv2d(wide, wide, 3, padding=1), nn.ReLU()]
        self.body, self.back = nn.Sequential(*layers), nn.Conv2d(wide, channels, 1)
        self.upscale = upscale

    def forward(self, x):
        wide = self.body(nn.functional.interpolate(x, scale_factor=self.upscale, mode="nearest"))
        return x + 1e-3 * self.back(nn.functional.avg_pool2d(wide, self.upscale))


class TwoHeads(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 4, outlier: bool = False, size: int = 16, slow: bool = False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.slow = Slow(channels) if slow else nn.Identity()
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.outlier = Outlier(channels) if outlier else nn.Identity()
        self.bev_pool = BevPool(size * size)
        self.seg = nn.Conv2d(channels, classes, 1)
        self.speed_head = nn.Linear(channels + 1, 1)

    def forward(self, images, ego_speed):
        x = self.stem(images.float() / 255.0)
        x = self.bev_pool(self.outlier(self.blocks(self.slow(x))))
        pooled = torch.cat([x.mean((2, 3)), ego_speed / 20.0], dim=1)  # inputs normalised, as real models do
        return {"segmentation": self.seg(x), "speed": self.speed_head(pooled)}


def make_net(outlier: bool = False, seed: int = 0, slow: bool = False) -> TwoHeads:
    torch.manual_seed(seed)
    net = TwoHeads(outlier=outlier, slow=slow).eval()
    with torch.no_grad():  # non-trivial batch-norm statistics, so folding is exercised
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 2.0)
    return net


def make_samples(count: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [{"images": rng.integers(0, 256, (1, 3, 16, 16), dtype=np.uint8),
             "ego_speed": rng.uniform(0, 20, (1, 1)).astype(np.float32)} for _ in range(count)]


def example_inputs() -> dict:
    return {name: torch.from_numpy(value) for name, value in make_samples(1, seed=99)[0].items()}




def segmentation_error(net: nn.Module, feeds: list):
    """An accuracy-gate evaluator: mean relative error of the segmentation logits against the PyTorch `net`."""

    def evaluate(run) -> dict:
        errors = []
        for sample in feeds:
            with torch.no_grad():
                expected = net(**{k: torch.from_numpy(v) for k, v in sample.items()})["segmentation"].numpy()
            errors.append(float(np.linalg.norm(run(sample)["segmentation"] - expected) / np.linalg.norm(expected)))
        return {"seg_rel_error": float(np.mean(errors))}

    return evaluate


# The quality gate judges what a stand-in network has none of (task heads, a planner that drives): these stand in
# for `stack eval`'s metrics and for the simulator's scored rows, so the orchestration around them is tested.
RECIPE_LIKE_METRICS = {"planning/L2_at_3s": 0.68, "planning/baseline_cv/L2_at_3s": 2.13,
                       "planning/baseline_ego_rollout/L2_at_3s": 0.854, "depth/AbsRel": 0.26,
                       "depth/baseline_mean_depth/AbsRel": 0.806, "segmentation/mIoU": 0.66,
                       "segmentation/baseline_majority/mIoU": 0.035, "detection/mAP": 0.22,
                       "detection/baseline_empty/mAP": 0.0, "planning/departure_reproduced": 0.3,
                       "planning/departure_share": 0.2, "detection/NDS": 0.36, "detection/baseline_empty/NDS": 0.0}


def heads_like_the_recipe(run) -> dict:
    """A quality evaluator whose figures clear every head bar (the runtime `run` is not needed to say so)."""
    return dict(RECIPE_LIKE_METRICS)


def drives(fp32_over_blind: float, int8_below_fp32: float = 0.0, episodes: int = 12):
    """A closed-loop gate stand-in: scored rows in which fp32 drives `fp32_over_blind` better than both blind
    policies (per-episode noise 0.05) and INT8 `int8_below_fp32` worse than fp32, through the real record."""
    from stack.deploy.gates.closed_loop import gate_record

    def gate(int8_path, fp32_path, budget, latency_ms, log) -> dict:
        rng = np.random.default_rng(0)
        base = rng.uniform(0.3, 0.7, episodes)
        offsets = {"constant_velocity": 0.0, "ego_rollout": 0.0, "fp32": fp32_over_blind, "expert": 0.4,
                   **({"int8": fp32_over_blind - int8_below_fp32} if int8_path else {})}
        rows = [{"policy": policy, "family": "straight", "seed": 0, "index": i,
                 "metrics": {"driving_score": float(base[i] + offset + rng.normal(0, 0.05)),
                             "pdms": float(base[i] + offset + rng.normal(0, 0.05)), "collisions": 0.0,
                             "route_completion": 1.0}}
                for policy, offset in offsets.items() for i in range(episodes)]
        drove = {"episodes": episodes, "latency_ms": latency_ms, "latency_how": "stand-in", "scenarios": ["straight"],
                 "seeds": [0], "episode_seconds": 10.0, "replan_hz": 2.0}
        return gate_record(rows, budget, bool(int8_path), drove)

    return gate
