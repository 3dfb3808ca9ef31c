"""The world renderer before all cameras were cast at once (ray caster + frame), kept verbatim as the reference.

`stack.sim.world.render` and `stack.sim.world.frame` are the fast renderer; this
module is what they must agree with: tests/data/test_render_equality.py compares
depth, semantics and instance ids exactly and RGB within a stated tolerance, and
`stack bench data` times both side by side on the same scenes. Do not optimise it.

The body below is the former render.py followed by the former frame.py; the edits are
that frame's `render.` prefixes now name this module's own functions, and that the scene's
primitives (`build_primitives`, `visible_rows`, their colours and materials) and the helpers
the speed-up left unchanged (the hit record, box normals, sun, façades, 2D boxes and object labels)
are imported from `render` and `frame` rather than kept as a second copy: what remains here is
the code the fast renderer replaced, and the comparison is of casting, shading and exposure.

Former render.py docstring:
Vectorised ray casting of a scene into RGB, metric z-depth, semantics and instance ids.

Every pixel's ray is intersected in one batched tensor expression with analytic
primitives: the ground plane (textured from the town's semantic raster),
oriented boxes (buildings, vehicle bodies and cabins, bicycles), vertical
cylinders (people, tree trunks) and spheres (heads, tree crowns). The nearest
hit wins; shading is Lambertian under a per-scene sun with sky ambient light,
hard shadows from a second ray cast toward the sun, procedural textures (asphalt,
paving, grass, façade windows), distance haze, exposure and white-balance
variation, and Gaussian sensor noise. Primitives outside a camera's frustum are
culled before the cast. Torch runs it on the GPU when one is given, else on the
CPU.

Ray directions are K⁻¹[u, v, 1] (unit z in the camera frame), so the ray
parameter of a hit *is* its z-depth (stack.rig convention).

Former frame.py docstring:
Render every camera of one key frame: images, depth, semantics, instances, visibility, 2D boxes.

This is where the ray caster (`stack.sim.world.render`) meets the rig (`stack.rig`)
and the look of a scene: sky gradient, sun and shadows, ground textures, façade
windows, haze, exposure, white balance and sensor noise.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from stack.sim.world.frame import HAZE, _boxes_2d, _facade, _object_labels, _sun  # unchanged: shared
from stack.sim.world.render import (  # the scene's primitives and the hit record, shared (see the docstring)
    FACADE, GLASS, GROUND_COLOURS, KINDS, MAX_RANGE, Hits, Primitives, _bounding_spheres, _box_normal, build_primitives,
    near_rows, visible_rows)
from stack.sim.world.roads import SEG, GroundRaster
from stack.sim.world.scene import Scene, ego_pose
from stack.pipeline import RigConfig
from stack.rig import rig_matrices

def _hit_boxes(origin, dirs, boxes):
    """(t (R, B), local hit axis (R, B)) of rays against yaw-rotated boxes; inf where missed.

    `origin` and `dirs` are (R, 3) or (1, 3) and broadcast (camera rays share one
    origin; shadow rays toward the sun share one direction).
    """
    rows = max(len(origin), len(dirs))
    if not len(boxes):
        return dirs.new_full((rows, 0), math.inf), None
    c, s = torch.cos(boxes[:, 6]), torch.sin(boxes[:, 6])

    def local(x, y, z):
        return torch.stack(torch.broadcast_tensors(c * x + s * y, -s * x + c * y, z), 2)

    rel_x, rel_y = origin[:, 0:1] - boxes[:, 0], origin[:, 1:2] - boxes[:, 1]
    o_local = local(rel_x, rel_y, origin[:, 2:3] - boxes[:, 2])
    d_local = local(dirs[:, 0:1], dirs[:, 1:2], dirs[:, 2:3].expand(-1, len(boxes)))
    inv = 1.0 / torch.where(d_local.abs() < 1e-9, torch.full_like(d_local, 1e-9), d_local)
    t1 = (-boxes[:, 3:6] - o_local) * inv
    t2 = (boxes[:, 3:6] - o_local) * inv
    near, axis = torch.minimum(t1, t2).max(dim=2)
    far = torch.maximum(t1, t2).amin(dim=2)
    hit = (near <= far) & (near > 0.05)
    return torch.where(hit, near, torch.full_like(near, math.inf)).expand(rows, -1), axis


def _hit_cylinders(origin, dirs, cyls):
    rows = max(len(origin), len(dirs))
    if not len(cyls):
        return dirs.new_full((rows, 0), math.inf)
    ox, oy = origin[:, 0:1] - cyls[:, 0], origin[:, 1:2] - cyls[:, 1]
    dx, dy = dirs[:, 0:1], dirs[:, 1:2]
    a = dx * dx + dy * dy + 1e-12
    b = dx * ox + dy * oy
    cc = ox * ox + oy * oy - cyls[:, 4] ** 2
    disc = b * b - a * cc
    t = (-b - disc.clamp(min=0).sqrt()) / a
    z = origin[:, 2:3] + t * dirs[:, 2:3]
    hit = (disc > 0) & (t > 0.05) & (z >= cyls[:, 2]) & (z <= cyls[:, 3])
    return torch.where(hit, t, torch.full_like(t, math.inf)).expand(rows, -1)


def _hit_spheres(origin, dirs, sphs):
    rows = max(len(origin), len(dirs))
    if not len(sphs):
        return dirs.new_full((rows, 0), math.inf)
    rel_x, rel_y, rel_z = (origin[:, k:k + 1] - sphs[:, k] for k in range(3))
    a = (dirs * dirs).sum(1, keepdim=True)
    b = dirs[:, 0:1] * rel_x + dirs[:, 1:2] * rel_y + dirs[:, 2:3] * rel_z
    cc = rel_x * rel_x + rel_y * rel_y + rel_z * rel_z - sphs[:, 3] ** 2
    disc = b * b - a * cc
    t = (-b - disc.clamp(min=0).sqrt()) / a
    hit = (disc > 0) & (t > 0.05)
    return torch.where(hit, t, torch.full_like(t, math.inf)).expand(rows, -1)


def in_shadow(points, sun, prims: Primitives, rows: dict) -> torch.Tensor:
    """bool (R,) whether points (R, 3) see the sun (unit direction (3,)) blocked by a box or a sphere.

    Shadow rays are parallel, so in a frame looking down the sun direction each
    caster covers a disc: only the points inside it get an exact ray test.
    """
    helper = torch.tensor([0.0, 0.0, 1.0] if abs(float(sun[2])) < 0.9 else [1.0, 0.0, 0.0], device=sun.device)
    e1 = torch.linalg.cross(sun, helper)
    e1 = e1 / e1.norm()
    basis = torch.stack([e1, torch.linalg.cross(sun, e1)], 1)
    lifted = points + 0.02 * sun
    q_points, along_points = points @ basis, points @ sun
    blocked = torch.zeros(len(points), dtype=torch.bool, device=points.device)
    spheres = _bounding_spheres(prims)
    for kind in ("boxes", "spheres"):
        centre, radius = spheres[kind][0][rows[kind]], spheres[kind][1][rows[kind]]
        if not len(centre):
            continue
        q_centre, along_centre = centre @ basis, centre @ sun
        near = (torch.cdist(q_points, q_centre) < radius) & (along_centre + radius > along_points[:, None])
        for index in torch.nonzero(near.any(0)).flatten().tolist():
            candidates = torch.nonzero(near[:, index]).flatten()
            t = _HIT[kind](lifted[candidates], sun[None], getattr(prims, kind)[rows[kind][index:index + 1]])
            blocked[candidates] |= torch.isfinite(t[:, 0])
    return blocked


def _box_single(o: list, d: torch.Tensor, box: list) -> torch.Tensor:
    """Ray parameter (...,) of rays from `o` along `d` (..., 3) against one box; inf where missed."""
    cx, cy, cz, hx, hy, hz, yaw = box
    c, s = math.cos(yaw), math.sin(yaw)
    rel_x, rel_y = o[0] - cx, o[1] - cy
    origin_local = (c * rel_x + s * rel_y, -s * rel_x + c * rel_y, o[2] - cz)
    dx, dy = d[..., 0], d[..., 1]
    directions = (dx * c + dy * s, dy * c - dx * s, d[..., 2])
    near = far = None
    for o_axis, d_axis, half in zip(origin_local, directions, (hx, hy, hz)):
        inv = 1.0 / torch.where(d_axis.abs() < 1e-9, torch.full_like(d_axis, 1e-9), d_axis)
        t1, t2 = (-half - o_axis) * inv, (half - o_axis) * inv
        low, high = torch.minimum(t1, t2), torch.maximum(t1, t2)
        near = low if near is None else torch.maximum(near, low)
        far = high if far is None else torch.minimum(far, high)
    return near.masked_fill_((near > far) | (near <= 0.05), math.inf)


def _cylinder_single(o: list, d: torch.Tensor, cyl: list) -> torch.Tensor:
    cx, cy, z0, z1, radius = cyl
    ox, oy = o[0] - cx, o[1] - cy
    dx, dy = d[..., 0], d[..., 1]
    a = dx * dx + dy * dy + 1e-12
    b = dx * ox + dy * oy
    disc = b * b - a * (ox * ox + oy * oy - radius * radius)
    t = (-b - disc.clamp(min=0).sqrt()) / a
    z = o[2] + t * d[..., 2]
    return t.masked_fill_((disc <= 0) | (t <= 0.05) | (z < z0) | (z > z1), math.inf)


def _sphere_single(o: list, d: torch.Tensor, sphere: list) -> torch.Tensor:
    cx, cy, cz, radius = sphere
    rx, ry, rz = o[0] - cx, o[1] - cy, o[2] - cz
    a = (d * d).sum(-1)
    b = d[..., 0] * rx + d[..., 1] * ry + d[..., 2] * rz
    disc = b * b - a * (rx * rx + ry * ry + rz * rz - radius * radius)
    t = (-b - disc.clamp(min=0).sqrt()) / a
    return t.masked_fill_((disc <= 0) | (t <= 0.05), math.inf)


_SINGLE = {"boxes": _box_single, "cylinders": _cylinder_single, "spheres": _sphere_single}
_HIT = {"boxes": lambda o, d, p: _hit_boxes(o, d, p)[0], "cylinders": _hit_cylinders, "spheres": _hit_spheres}


def screen_rects(centre_cam: torch.Tensor, radius: torch.Tensor, k: np.ndarray, width: int, height: int) -> list:
    """Conservative pixel rectangles (v0, v1, u0, u1) covering bounding spheres given in the camera frame."""
    rects = []
    for (x, y, z), r in zip(centre_cam.tolist(), radius.tolist()):
        if z - r < 0.1:
            rects.append((0, height, 0, width))
            continue
        span = []
        for value, focal, centre, size in ((x, k[0, 0], k[0, 2], width), (y, k[1, 1], k[1, 2], height)):
            low = (value - r) / (z - r) if value - r <= 0 else (value - r) / (z + r)
            high = (value + r) / (z - r) if value + r >= 0 else (value + r) / (z + r)
            span += [max(int(math.floor(centre + focal * low)), 0), min(int(math.ceil(centre + focal * high)) + 1, size)]
        rects.append((span[2], span[3], span[0], span[1]))
    return rects


def cast(origin, dirs, prims: Primitives, rows: dict, ground, camera: tuple) -> tuple[Hits, dict]:
    """Nearest hits of one camera's rays (H*W, shared origin) and per-kind (rows, all-hit, nearest-hit) counts.

    Each culled primitive is tested only against the pixels inside its projected
    bounding rectangle (`camera` = (K, world_from_cam tensor, width, height)), so
    the work follows screen coverage rather than pixels x primitives.
    """
    k, world_from_cam, width, height = camera
    depth = torch.where(dirs[:, 2] < -1e-6, -origin[2] / dirs[:, 2].clamp(max=-1e-6), torch.full_like(dirs[:, 2], math.inf))
    depth_image, dirs_image = depth.view(height, width), dirs.view(height, width, 3)
    winner = torch.full((height, width), -1, dtype=torch.long, device=dirs.device)
    counts, offset, origin_list = {}, 0, origin.tolist()
    for kind in KINDS:
        selected = getattr(prims, kind)[rows[kind]]
        centre, radius = _bounding_spheres(prims)[kind]
        centre_cam = (centre[rows[kind]] - world_from_cam[:3, 3]) @ world_from_cam[:3, :3]
        all_hits = torch.zeros(len(selected), device=dirs.device)
        is_agent = (prims.attributes[kind][rows[kind], 1] > 0).tolist()
        for index, (v0, v1, u0, u1) in enumerate(screen_rects(centre_cam, radius[rows[kind]], k, width, height)):
            if v0 >= v1 or u0 >= u1:
                continue
            t = _SINGLE[kind](origin_list, dirs_image[v0:v1, u0:u1], selected[index].tolist())
            if is_agent[index]:
                all_hits[index] = torch.isfinite(t).sum()
            window = depth_image[v0:v1, u0:u1]
            closer = t < window
            torch.minimum(t, window, out=t)
            window.copy_(t)
            winner[v0:v1, u0:u1].masked_fill_(closer, offset + index)
        counts[kind] = (rows[kind], all_hits, offset)
        offset += len(selected)
    winner = winner.flatten()
    for kind in KINDS:
        selected_rows, all_hits, start = counts[kind]
        counts[kind] = (selected_rows, all_hits, _nearest_counts(winner, start, len(all_hits)))
    point = origin + dirs * torch.where(torch.isfinite(depth), depth, torch.zeros_like(depth))[:, None]
    return _shade_inputs(point, depth, winner, prims, rows, ground), counts


def _nearest_counts(winner, start, count):
    inside = (winner >= start) & (winner < start + count)
    return torch.bincount(winner[inside] - start, minlength=count)


def _shade_inputs(point, depth, winner, prims, rows, ground) -> Hits:
    rays = len(point)
    normal = torch.zeros_like(point)
    normal[:, 2] = 1.0
    semantic = torch.full((rays,), SEG["sky"], dtype=torch.long, device=point.device)
    instance = torch.zeros(rays, dtype=torch.long, device=point.device)
    albedo = torch.zeros_like(point)
    material = torch.zeros(rays, dtype=torch.long, device=point.device)
    facade_uv = torch.zeros(rays, 2, device=point.device)
    is_ground = (winner < 0) & torch.isfinite(depth)
    semantic[is_ground] = ground.classes_at(point[is_ground])
    start = 0
    for kind in KINDS:
        count = len(rows[kind])
        mask = (winner >= start) & (winner < start + count)
        local_index = winner[mask] - start
        start += count
        if not mask.any():
            continue
        attrs = prims.attributes[kind][rows[kind][local_index]]
        semantic[mask], instance[mask] = attrs[:, 0].long(), attrs[:, 1].long()
        albedo[mask], material[mask] = attrs[:, 2:5], attrs[:, 5].long()
        geometry, p = getattr(prims, kind)[rows[kind][local_index]], point[mask]
        if kind == "boxes":
            normal[mask], facade_uv[mask] = _box_normal(geometry, p)
        elif kind == "cylinders":
            radial = p[:, :2] - geometry[:, :2]
            normal[mask] = torch.nn.functional.pad(radial / radial.norm(dim=1, keepdim=True).clamp(min=1e-6), (0, 1))
        else:
            normal[mask] = (p - geometry[:, :3]) / geometry[:, 3:4]
    return Hits(depth, point, normal, semantic, instance, albedo, material, facade_uv)


# ---- former frame.py ----


class TorchGround:
    """The town's ground raster as tensors, with per-point class and albedo lookup."""

    def __init__(self, ground: GroundRaster, texture_seed: int, device):
        self.classes = torch.as_tensor(ground.classes, device=device).long()
        self.yellow = torch.as_tensor(ground.yellow, device=device)
        self.origin, self.cell = ground.origin, ground.cell
        generator = torch.Generator().manual_seed(texture_seed)
        self.noise = torch.rand(256, 256, generator=generator).to(device)
        self.palette = torch.zeros(len(SEG), 3, device=device)
        for cls, colour in GROUND_COLOURS.items():
            self.palette[cls] = torch.tensor(colour, device=device)

    def _cells(self, points):
        col = ((points[:, 0] - self.origin[0]) / self.cell).floor().long()
        row = ((points[:, 1] - self.origin[1]) / self.cell).floor().long()
        h, w = self.classes.shape
        inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
        return row.clamp(0, h - 1), col.clamp(0, w - 1), inside

    def classes_at(self, points):
        row, col, inside = self._cells(points)
        return torch.where(inside, self.classes[row, col], torch.full_like(row, SEG["vegetation"]))

    def albedo(self, points, classes):
        """Ground colour with texture: asphalt grain, paving joints, grass patches, yellow centre lines."""
        row, col, inside = self._cells(points)
        colour = self.palette[classes]
        fine = self.noise[(points[:, 1] * 8).long() % 256, (points[:, 0] * 8).long() % 256]
        coarse = self.noise[(points[:, 1] * 0.5).long() % 256, (points[:, 0] * 0.5).long() % 256]
        grain = torch.where(classes == SEG["vegetation"], 0.65 + 0.45 * coarse + 0.2 * fine, 0.85 + 0.15 * coarse + 0.12 * fine)
        joints = (torch.remainder(points[:, 0], 1.5) < 0.06) | (torch.remainder(points[:, 1], 1.5) < 0.06)
        grain = torch.where((classes == SEG["sidewalk"]) & joints, grain * 0.75, grain)
        yellow = (classes == SEG["lane_marking"]) & self.yellow[row, col] & inside
        colour = torch.where(yellow[:, None], torch.tensor([0.85, 0.68, 0.15], device=points.device), colour)
        return colour * grain[:, None]


def shade(hits: Hits, dirs, ground: TorchGround, sun, shadowed) -> torch.Tensor:
    """Linear RGB (R, 3) of every ray's hit, before exposure and noise."""
    is_ground = (hits.instance == 0) & (hits.normal[:, 2] > 0.99) & torch.isin(
        hits.semantic, torch.tensor([SEG["road"], SEG["lane_marking"], SEG["sidewalk"], SEG["vegetation"]], device=dirs.device))
    albedo = torch.where(is_ground[:, None], ground.albedo(hits.point, hits.semantic), hits.albedo)
    albedo = torch.where((hits.material == FACADE)[:, None], _facade(hits.facade_uv, albedo), albedo)
    lambert = (hits.normal @ sun).clamp(min=0.0) * (~shadowed).float()
    sky_light = 0.35 + 0.15 * hits.normal[:, 2]
    colour = albedo * (sky_light + 0.95 * lambert)[:, None]
    glass = hits.material == GLASS
    colour = torch.where(glass[:, None], colour + 0.12 * (1 - dirs[:, 2:3].abs()), colour)
    haze = 1.0 - torch.exp(-hits.depth.nan_to_num(posinf=MAX_RANGE) / 300.0)
    colour = colour * (1 - haze[:, None]) + HAZE.to(dirs.device) * haze[:, None]
    unit = dirs / dirs.norm(dim=1, keepdim=True)
    elevation = unit[:, 2:3].clamp(min=0)
    horizon, zenith = (torch.tensor(c, device=dirs.device) for c in ([0.75, 0.82, 0.9], [0.35, 0.5, 0.8]))
    sky = horizon * (1 - elevation) + zenith * elevation
    sky = sky + 0.6 * (unit @ sun).clamp(min=0)[:, None] ** 64
    return torch.where(torch.isfinite(hits.depth)[:, None], colour, sky)


def camera_rays(k: np.ndarray, world_from_cam: np.ndarray, width: int, height: int, device):
    """(origin (3,), world directions (H*W, 3) with unit camera-frame z) of a camera."""
    v, u = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    pixels = np.stack([u.ravel(), v.ravel(), np.ones(u.size)], axis=1)
    cam_dirs = pixels @ np.linalg.inv(k).T
    world_dirs = cam_dirs @ world_from_cam[:3, :3].T
    return (torch.tensor(world_from_cam[:3, 3], dtype=torch.float32, device=device),
            torch.tensor(world_dirs, dtype=torch.float32, device=device))


def render_frame(scene: Scene, step_index: int, rig: RigConfig, ground: TorchGround,
                 rng: np.random.Generator, device="cpu") -> dict:
    """All cameras of one key frame plus its object labels (numpy arrays, ready for the shard writer)."""
    ks, cam_to_ego = rig_matrices(rig)
    pose = ego_pose(scene, step_index)
    prims, major = build_primitives(scene.town, scene.agents, step_index, device)
    sun = _sun(scene.light, device)
    height, width = rig.image_height, rig.image_width
    out = {"images": [], "depth": [], "semantic": [], "instance": []}
    seen = {kind: torch.zeros(len(getattr(prims, kind)), device=device) for kind in ("boxes", "cylinders", "spheres")}
    unoccluded = {kind: torch.zeros_like(count) for kind, count in seen.items()}
    boxes_2d = []
    for index in range(len(rig.cameras)):
        world_from_cam = pose @ cam_to_ego[index]
        origin, dirs = camera_rays(ks[index], world_from_cam, width, height, device)
        tan_half = (width / 2 / ks[index][0, 0], height / 2 / ks[index][1, 1])
        world_from_cam_t = torch.tensor(world_from_cam, dtype=torch.float32, device=device)
        rows = visible_rows(prims, world_from_cam_t, tan_half)
        hits, counts = cast(origin, dirs, prims, rows, ground, (ks[index], world_from_cam_t, width, height))
        for kind, (selected, all_hits, nearest) in counts.items():
            unoccluded[kind].index_add_(0, selected, all_hits.float())
            seen[kind].index_add_(0, selected, nearest.float())
        lit = torch.isfinite(hits.depth) & ((hits.normal @ sun) > 0)
        shadowed = torch.zeros_like(lit)
        if lit.any():
            shadowed[lit] = in_shadow(hits.point[lit], sun, prims, near_rows(prims, origin, 80.0))
        colour = shade(hits, dirs, ground, sun, shadowed)
        out["images"].append(_expose(colour, scene.light, rng).reshape(height, width, 3))
        finite = torch.isfinite(hits.depth)
        out["depth"].append(torch.where(finite, hits.depth.clamp(max=1000.0), torch.zeros_like(hits.depth))
                            .reshape(height, width).cpu().numpy().astype(np.float16))
        out["semantic"].append(hits.semantic.reshape(height, width).cpu().numpy().astype(np.uint8))
        out["instance"].append(hits.instance.reshape(height, width).cpu().numpy().astype(np.uint16))
        boxes_2d += _boxes_2d(out["instance"][-1], index)
    frame = {key: np.stack(value) for key, value in out.items()}
    frame["boxes"], frame["box_ids"], frame["visibility"] = _object_labels(scene, step_index, major, seen, unoccluded)
    frame["boxes2d"] = np.array(boxes_2d, np.float32).reshape(-1, 6)
    frame["intrinsics"], frame["cam_to_ego"] = ks.astype(np.float32), cam_to_ego.astype(np.float32)
    return frame


def _expose(colour: torch.Tensor, light: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Exposure, white balance, 8-bit quantisation and Gaussian sensor noise."""
    gain = torch.tensor([light[2] * light[3], light[2], light[2] * light[4]], dtype=torch.float32, device=colour.device)
    linear = (colour * gain).clamp(0.0, 1.0).cpu().numpy() * 255.0
    noisy = linear + rng.normal(0.0, 2.5, size=linear.shape)
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)


