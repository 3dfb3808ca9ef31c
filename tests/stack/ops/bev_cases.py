"""Rigs, geometries and an independent numpy LSS used by the BEV pooling tests."""

import itertools
import math
import random

import numpy as np

import torch

from stack.ops import bev_geometry
from stack.pipeline import BevGridConfig, Camera, DepthBinsConfig, RigConfig
from stack.rig import rig_matrices


def random_rig(seed: int, cameras: int, width: int = 128, height: int = 64) -> RigConfig:
    rng = random.Random(seed)
    cams = [Camera(name=f"cam{i}", x=rng.uniform(-1, 2), y=rng.uniform(-1, 1), z=rng.uniform(1.2, 2.0),
                   yaw_deg=rng.uniform(-180, 180), pitch_deg=rng.uniform(-5, 15), hfov_deg=rng.uniform(50, 110))
            for i in range(cameras)]
    return RigConfig(image_width=width, image_height=height, cameras=cams)


def rig_tensors(rigs: list, dtype=torch.float32):
    """(K (B, N, 3, 3), cam_to_ego (B, N, 4, 4)) for one rig per sample."""
    mats = [rig_matrices(r) for r in rigs]
    return (torch.stack([torch.tensor(k, dtype=dtype) for k, _ in mats]),
            torch.stack([torch.tensor(t, dtype=dtype) for _, t in mats]))


def make_geometry(batch=2, cameras=3, bins=8, stride=8, width=128, height=64, seed=0,
                  bev: BevGridConfig | None = None, device="cpu"):
    rigs = [random_rig(seed + b, cameras, width, height) for b in range(batch)]
    k, pose = rig_tensors(rigs)
    depth = DepthBinsConfig(min_m=1.0, max_m=41.0, bins=bins)
    bev = bev or BevGridConfig(x_range=[-40.0, 40.0], y_range=[-40.0, 40.0], z_range=[-2.0, 4.0], cell_size=4.0)
    return bev_geometry(k.to(device), pose.to(device), (height, width), stride, depth, bev), rigs, depth, bev


def random_inputs(geometry, channels=5, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = geometry
    depth = torch.rand(g.batch, g.cameras, g.depth_bins, g.feat_h, g.feat_w, generator=gen, dtype=dtype)
    context = torch.randn(g.batch, g.cameras, channels, g.feat_h, g.feat_w, generator=gen, dtype=dtype)
    return depth.softmax(2).to(device), context.to(device)


def bev_pool_naive(depth, context, rigs, depth_cfg, bev, stride):
    """LSS as written in the paper, in numpy float64: every frustum point, dropped or added to its cell."""
    batch, cameras, bins, height, width = depth.shape
    cells_x = round((bev.x_range[1] - bev.x_range[0]) / bev.cell_size)
    cells_y = round((bev.y_range[1] - bev.y_range[0]) / bev.cell_size)
    out = np.zeros((batch, cells_x, cells_y, context.shape[2]))
    depth, context = depth.double().cpu().numpy(), context.double().cpu().numpy()
    step = (depth_cfg.max_m - depth_cfg.min_m) / bins
    for b, rig in enumerate(rigs):
        ks, poses = rig_matrices(rig)
        for n, d, h, w in itertools.product(range(cameras), range(bins), range(height), range(width)):
            pixel = np.array([(w + 0.5) * stride, (h + 0.5) * stride, 1.0])
            ego = poses[n] @ np.append(np.linalg.solve(ks[n], pixel) * (depth_cfg.min_m + (d + 0.5) * step), 1.0)
            ix = math.floor((ego[0] - bev.x_range[0]) / bev.cell_size)
            iy = math.floor((ego[1] - bev.y_range[0]) / bev.cell_size)
            if 0 <= ix < cells_x and 0 <= iy < cells_y and bev.z_range[0] <= ego[2] < bev.z_range[1]:
                out[b, ix, iy] += depth[b, n, d, h, w] * context[b, n, :, h, w]
    return torch.from_numpy(out).permute(0, 3, 1, 2)
