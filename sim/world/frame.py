"""Render every camera of one key frame: images, depth, semantics, instances, visibility, 2D boxes.

This is where the ray caster (`stack.sim.world.render`) meets the rig (`stack.rig`)
and the look of a scene: sky gradient, sun and shadows, ground textures, façade
windows, haze, exposure, white balance and sensor noise.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from stack.sim.world import render
from stack.sim.world.roads import SEG, GroundRaster
from stack.sim.world.scene import Scene, agent_boxes, ego_pose
from stack.pipeline import RigConfig
from stack.rig import rig_matrices

HAZE = torch.tensor([0.72, 0.78, 0.85])


class TorchGround:
    """The town's ground raster as tensors, with per-point class and albedo lookup."""

    def __init__(self, ground: GroundRaster, texture_seed: int, device):
        self.classes = torch.as_tensor(ground.classes, device=device).long()
        self.yellow = torch.as_tensor(ground.yellow, device=device)
        self.origin, self.cell = ground.origin, ground.cell
        generator = torch.Generator().manual_seed(texture_seed)
        self.noise = torch.rand(256, 256, generator=generator).to(device)
        self.palette = torch.zeros(len(SEG), 3, device=device)
        for cls, colour in render.GROUND_COLOURS.items():
            self.palette[cls] = torch.tensor(colour, device=device)

    def _cells(self, points):
        col = ((points[:, 0] - self.origin[0]) / self.cell).floor().long()
        row = ((points[:, 1] - self.origin[1]) / self.cell).floor().long()
        h, w = self.classes.shape
        inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
        return row.clamp(0, h - 1), col.clamp(0, w - 1), inside

    def classes_at(self, points):
        row, col, inside = self._cells(points)
        cells = self.classes.view(-1).index_select(0, row * self.classes.shape[1] + col)
        return torch.where(inside, cells, torch.full_like(row, SEG["vegetation"]))

    def albedo(self, points, classes):
        """Ground colour with texture: asphalt grain, paving joints, grass patches, yellow centre lines."""
        row, col, inside = self._cells(points)
        colour = self.palette.index_select(0, classes)
        noise = self.noise.view(-1)
        fine = noise.index_select(0, (points[:, 1] * 8).long() % 256 * 256 + (points[:, 0] * 8).long() % 256)
        coarse = noise.index_select(0, (points[:, 1] * 0.5).long() % 256 * 256 + (points[:, 0] * 0.5).long() % 256)
        grain = torch.where(classes == SEG["vegetation"], 0.65 + 0.45 * coarse + 0.2 * fine, 0.85 + 0.15 * coarse + 0.12 * fine)
        joints = (torch.remainder(points[:, 0], 1.5) < 0.06) | (torch.remainder(points[:, 1], 1.5) < 0.06)
        grain = torch.where((classes == SEG["sidewalk"]) & joints, grain * 0.75, grain)
        yellow = (classes == SEG["lane_marking"]) & self.yellow.view(-1).index_select(0, row * self.yellow.shape[1] + col) & inside
        colour = torch.where(yellow[:, None], torch.tensor([0.85, 0.68, 0.15], device=points.device), colour)
        return colour * grain[:, None]


def _sun(light: np.ndarray, device) -> torch.Tensor:
    azimuth, elevation = float(light[0]), float(light[1])
    return torch.tensor([math.cos(elevation) * math.cos(azimuth), math.cos(elevation) * math.sin(azimuth),
                         math.sin(elevation)], dtype=torch.float32, device=device)


def _facade(uv, albedo):
    """Windows on building façades: a grid of dark glass panes above the ground floor."""
    u, v = torch.remainder(uv[:, 0], 3.2) / 3.2, torch.remainder(uv[:, 1], 3.2) / 3.2
    window = (u > 0.25) & (u < 0.75) & (v > 0.3) & (v < 0.78) & (uv[:, 1] > 1.5)
    return torch.where(window[:, None], torch.tensor([0.12, 0.16, 0.22], device=uv.device), albedo)


GROUND_CLASSES = (SEG["road"], SEG["lane_marking"], SEG["sidewalk"], SEG["vegetation"])


def shade(hits: render.Hits, dirs, ground: TorchGround, sun, shadowed) -> torch.Tensor:
    """Linear RGB (R, 3) of every ray's hit, before exposure and noise.

    Each term is evaluated only on the rays it applies to (ground texture on ground rays, façade windows on
    façades, the sky gradient on sky rays): the reference evaluated every term on every ray and selected."""
    colour = torch.empty_like(dirs)
    finite = torch.isfinite(hits.depth)
    surface, sky_rays = torch.nonzero(finite).flatten(), torch.nonzero(~finite).flatten()

    def at(values, index=surface):
        return values.index_select(0, index)

    normal, semantic, material, albedo = at(hits.normal), at(hits.semantic), at(hits.material), at(hits.albedo)
    ground_class = torch.zeros(len(SEG), dtype=torch.bool, device=dirs.device)
    ground_class[list(GROUND_CLASSES)] = True  # a lookup table: torch.isin took 6 ms a frame
    on_ground = torch.nonzero((at(hits.instance) == 0) & (normal[:, 2] > 0.99)
                              & ground_class.index_select(0, semantic)).flatten()
    albedo.index_copy_(0, on_ground, ground.albedo(at(hits.point, at(surface, on_ground)), at(semantic, on_ground)))
    facade = torch.nonzero(material == render.FACADE).flatten()
    albedo.index_copy_(0, facade, _facade(at(hits.facade_uv, at(surface, facade)), at(albedo, facade)))
    lambert = (normal @ sun).clamp(min=0.0) * (~at(shadowed)).float()
    sky_light = 0.35 + 0.15 * normal[:, 2]
    lit = albedo * (sky_light + 0.95 * lambert)[:, None]
    glass = torch.nonzero(material == render.GLASS).flatten()
    lit.index_copy_(0, glass, at(lit, glass) + 0.12 * (1 - at(dirs, at(surface, glass))[:, 2:3].abs()))
    haze = 1.0 - torch.exp(-at(hits.depth) / 300.0)
    colour.index_copy_(0, surface, lit * (1 - haze[:, None]) + HAZE.to(dirs.device) * haze[:, None])
    sky_dirs = at(dirs, sky_rays)
    unit = sky_dirs / sky_dirs.norm(dim=1, keepdim=True)
    elevation = unit[:, 2:3].clamp(min=0)
    horizon, zenith = (torch.tensor(c, device=dirs.device) for c in ([0.75, 0.82, 0.9], [0.35, 0.5, 0.8]))
    sky = horizon * (1 - elevation) + zenith * elevation
    colour.index_copy_(0, sky_rays, sky + 0.6 * (unit @ sun).clamp(min=0)[:, None] ** 64)
    return colour


@functools.lru_cache(maxsize=32)
def _camera_frame_dirs(k_bytes: bytes, width: int, height: int) -> np.ndarray:
    """(H*W, 3) K^-1 [u, v, 1] of every pixel centre, per intrinsics (the same for every frame of a rig)."""
    k = np.frombuffer(k_bytes, np.float64).reshape(3, 3)
    v, u = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    pixels = np.stack([u.ravel(), v.ravel(), np.ones(u.size)], axis=1)
    return pixels @ np.linalg.inv(k).T


def camera_rays(k: np.ndarray, world_from_cam: np.ndarray, width: int, height: int, device):
    """(origin (3,), world directions (H*W, 3) with unit camera-frame z) of a camera."""
    world_dirs = _camera_frame_dirs(np.asarray(k, np.float64).tobytes(), width, height) @ world_from_cam[:3, :3].T
    return (torch.tensor(world_from_cam[:3, 3], dtype=torch.float32, device=device),
            torch.tensor(world_dirs, dtype=torch.float32, device=device))


def _boxes_2d(instance: np.ndarray, camera: int) -> list:
    """[camera, track id, x0, y0, x1, y1] (pixels, inclusive-exclusive) of every instance visible in one image."""
    rows = []
    for track in np.unique(instance):
        if track == 0:
            continue
        ys, xs = np.nonzero(instance == track)
        rows.append([camera, track, xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
    return rows


def render_frame(scene: Scene, step_index: int, rig: RigConfig, ground: TorchGround,
                 rng: np.random.Generator, device="cpu") -> dict:
    """All cameras of one key frame plus its object labels (numpy arrays, ready for the shard writer).

    The cameras are cast, shadowed, shaded and exposed together (one tensor expression per stage for the
    whole rig); `raycast_reference.render_frame` is the camera-by-camera original it agrees with."""
    ks, cam_to_ego = rig_matrices(rig)
    pose = ego_pose(scene, step_index)
    prims, major = render.build_primitives(scene.town, scene.agents, step_index, device)
    sun = _sun(scene.light, device)
    height, width = rig.image_height, rig.image_width
    cameras, origins, dirs = [], [], []
    casters = {kind: [] for kind in ("boxes", "spheres")}
    for index in range(len(rig.cameras)):
        world_from_cam = pose @ cam_to_ego[index]
        origin, camera_dirs = camera_rays(ks[index], world_from_cam, width, height, device)
        k = ks[index]  # the frustum's widest half on each axis (a measured camera's principal point may be off-centre)
        tan_half = (max(k[0, 2], width - k[0, 2]) / k[0, 0], max(k[1, 2], height - k[1, 2]) / k[1, 1])
        world_from_cam_t = torch.tensor(world_from_cam, dtype=torch.float32, device=device)
        cameras.append(render.Camera(ks[index], world_from_cam_t, render.visible_rows(prims, world_from_cam_t, tan_half)))
        origins.append(origin), dirs.append(camera_dirs)
        for kind, rows in render.near_rows(prims, origin, 80.0).items():
            if kind in casters:
                mask = torch.zeros(len(getattr(prims, kind)), dtype=torch.bool, device=device)
                casters[kind].append(mask.index_fill_(0, rows, True))
    origins, dirs = torch.stack(origins), torch.cat(dirs)
    hits, counts = render.cast_frame(dirs, origins, prims, cameras, ground, (width, height))
    camera_of_ray = torch.arange(len(cameras), device=device).repeat_interleave(width * height)
    lit = torch.nonzero(torch.isfinite(hits.depth) & ((hits.normal @ sun) > 0)).flatten()
    shadowed = torch.zeros(len(dirs), dtype=torch.bool, device=device)
    shadowed[lit] = render.in_shadow(hits.point[lit], camera_of_ray[lit], sun, prims,
                                     {kind: torch.stack(masks) for kind, masks in casters.items()})
    colour = shade(hits, dirs, ground, sun, shadowed)
    shape = (len(cameras), height, width)
    finite = torch.isfinite(hits.depth)
    frame = {"images": _expose(colour, scene.light, rng).reshape(*shape, 3),
             "depth": torch.where(finite, hits.depth.clamp(max=1000.0), torch.zeros_like(hits.depth))
             .reshape(shape).cpu().numpy().astype(np.float16),
             "semantic": hits.semantic.reshape(shape).cpu().numpy().astype(np.uint8),
             "instance": hits.instance.reshape(shape).cpu().numpy().astype(np.uint16)}
    seen = {kind: nearest for kind, (_, nearest) in counts.items()}
    unoccluded = {kind: all_hits for kind, (all_hits, _) in counts.items()}
    frame["boxes"], frame["box_ids"], frame["visibility"] = _object_labels(scene, step_index, major, seen, unoccluded)
    boxes_2d = [row for index in range(len(cameras)) for row in _boxes_2d(frame["instance"][index], index)]
    frame["boxes2d"] = np.array(boxes_2d, np.float32).reshape(-1, 6)
    frame["intrinsics"], frame["cam_to_ego"] = ks.astype(np.float32), cam_to_ego.astype(np.float32)
    return frame


def _expose(colour: torch.Tensor, light: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Exposure, white balance, 8-bit quantisation and Gaussian sensor noise."""
    gain = torch.tensor([light[2] * light[3], light[2], light[2] * light[4]], dtype=torch.float32, device=colour.device)
    linear = (colour * gain).clamp(0.0, 1.0).cpu().numpy() * 255.0
    noisy = rng.normal(0.0, 2.5, size=linear.shape)
    noisy += linear
    return np.clip(np.rint(noisy, out=noisy), 0, 255, out=noisy).astype(np.uint8)


def _object_labels(scene: Scene, step_index: int, major: dict, seen: dict, unoccluded: dict):
    """3D boxes, [class, track id, attribute], and visibility (visible / unoccluded pixels of each agent's main
    part)."""
    boxes, ids = agent_boxes(scene, step_index)
    visibility = np.zeros(len(boxes), np.float32)
    for row, (_, track, _) in enumerate(ids):
        kind, index = major[int(track)]
        total = float(unoccluded[kind][index])
        visibility[row] = float(seen[kind][index]) / total if total > 0 else 0.0
    return boxes, ids, visibility
