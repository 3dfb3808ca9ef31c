"""Vectorised ray casting of a scene into RGB, metric z-depth, semantics and instance ids.

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

All cameras of a frame are cast at once: each culled primitive is tested
only against the pixels of its projected bounding rectangle (boxes: their projected
corners), as (pixel, primitive) pairs in one expression per kind, reduced to the
nearest hit per pixel; shadow rays are cast only from points inside a caster's disc
in the sun's view, found through a grid. `raycast_reference` is the former
camera-by-camera caster; tests/data/test_render_equality.py holds the two equal.

Ray directions are K⁻¹[u, v, 1] (unit z in the camera frame), so the ray
parameter of a hit *is* its z-depth (stack.rig convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from stack.sim.world.roads import SEG, Town

MAX_RANGE = 250.0
"""Rays that hit nothing closer are sky (above the horizon) or distant ground."""
CAR_COLOURS = torch.tensor([[0.75, 0.75, 0.78], [0.08, 0.08, 0.09], [0.55, 0.05, 0.05], [0.1, 0.2, 0.5],
                            [0.45, 0.47, 0.5], [0.85, 0.85, 0.85], [0.2, 0.35, 0.25], [0.6, 0.5, 0.3],
                            [0.9, 0.6, 0.1], [0.3, 0.1, 0.35], [0.15, 0.15, 0.18], [0.7, 0.1, 0.1]])
BUILDING_COLOURS = torch.tensor([[0.62, 0.55, 0.48], [0.7, 0.68, 0.62], [0.5, 0.3, 0.25], [0.78, 0.75, 0.7],
                                 [0.45, 0.45, 0.48], [0.6, 0.62, 0.55], [0.72, 0.6, 0.45], [0.35, 0.33, 0.32]])
GROUND_COLOURS = {SEG["road"]: (0.26, 0.26, 0.28), SEG["lane_marking"]: (0.85, 0.85, 0.82),
                  SEG["sidewalk"]: (0.58, 0.56, 0.53), SEG["vegetation"]: (0.24, 0.4, 0.16)}
MATTE, FACADE, GLASS = 0, 1, 2


@dataclass
class Primitives:
    """Scene geometry in the world frame; every row also has class, instance id, RGB albedo and material."""

    boxes: torch.Tensor
    """(B, 7) centre xyz, half length/width/height, yaw."""
    cylinders: torch.Tensor
    """(C, 5) centre xy, bottom z, top z, radius."""
    spheres: torch.Tensor
    """(S, 4) centre xyz, radius."""
    attributes: dict
    """kind -> (n, 6) float: class, instance, r, g, b, material."""


def _attr(cls: int, inst: int, colour, material: int = MATTE) -> list:
    return [cls, inst, float(colour[0]), float(colour[1]), float(colour[2]), material]


def _agent_parts(agent, x, y, yaw, boxes, cyls, sphs, attrs) -> None:
    """Append the primitives of one agent (the first one is its 'major' part, used for visibility)."""
    length, width, height = agent.size
    cls, inst = SEG[agent.kind], agent.track_id
    colour = CAR_COLOURS[agent.colour % len(CAR_COLOURS)]
    c, s = math.cos(yaw), math.sin(yaw)
    if agent.kind in ("car", "truck"):
        body_top = height * (0.62 if agent.kind == "car" else 1.0)
        cargo = 0.72 if agent.kind == "truck" else 1.0
        shift = -(1 - cargo) / 2 * length
        boxes.append([x + c * shift, y + s * shift, (0.25 + body_top) / 2,
                      length * cargo / 2, width / 2, (body_top - 0.25) / 2, yaw])
        attrs["boxes"].append(_attr(cls, inst, colour if agent.kind == "car" else (0.85, 0.85, 0.82)))
        cab_len = length * (0.5 if agent.kind == "car" else 0.26)
        cab_x = -0.08 * length if agent.kind == "car" else length / 2 - cab_len / 2
        cab_bottom = body_top if agent.kind == "car" else 0.4
        boxes.append([x + c * cab_x, y + s * cab_x, (cab_bottom + height) / 2,
                      cab_len / 2, width * 0.44, (height - cab_bottom) / 2, yaw])
        glass = agent.kind == "car"  # car cabins are windows; a truck cab is painted
        attrs["boxes"].append(_attr(cls, inst, (0.12, 0.15, 0.2) if glass else colour, GLASS if glass else MATTE))
        return
    head = 0.12
    body_radius = width * 0.38
    if agent.kind == "pedestrian":
        cyls.append([x, y, 0.0, height - 2 * head, body_radius])
        attrs["cylinders"].append(_attr(cls, inst, colour))
    else:
        cyls.append([x - c * 0.1, y - s * 0.1, height * 0.5, height - 2 * head, body_radius])
        attrs["cylinders"].append(_attr(cls, inst, colour))
        boxes.append([x, y, 0.5, length / 2, 0.08, 0.45, yaw])
        attrs["boxes"].append(_attr(cls, inst, (0.1, 0.1, 0.1)))
    sphs.append([x, y, height - head, head])
    attrs["spheres"].append(_attr(cls, inst, (0.8, 0.62, 0.5)))


def build_primitives(town: Town, agents: list, step_index: int, device="cpu") -> tuple[Primitives, dict]:
    """World-frame primitives at a simulation step, and track id -> index of its major primitive (kind, row)."""
    boxes, cyls, sphs = [], [], []
    attrs = {"boxes": [], "cylinders": [], "spheres": []}
    for x, y, yaw, length, width, height, colour in town.buildings:
        boxes.append([x, y, height / 2, length / 2, width / 2, height / 2, yaw])
        attrs["boxes"].append(_attr(SEG["building"], 0, BUILDING_COLOURS[int(colour)], FACADE))
    for x, y, radius, crown in town.trees:
        cyls.append([x, y, 0.0, crown, 0.18])
        attrs["cylinders"].append(_attr(SEG["vegetation"], 0, (0.3, 0.22, 0.15)))
        sphs.append([x, y, crown, radius])
        attrs["spheres"].append(_attr(SEG["vegetation"], 0, (0.16, 0.33, 0.1)))
    major = {}
    for agent in agents:
        x, y, yaw = agent.history[step_index][:3]
        kind = "boxes" if agent.kind in ("car", "truck") else "cylinders"
        major[agent.track_id] = (kind, len({"boxes": boxes, "cylinders": cyls}[kind]))
        _agent_parts(agent, x, y, yaw, boxes, cyls, sphs, attrs)

    def tensor(rows, width):
        return torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1, width)

    prims = Primitives(tensor(boxes, 7), tensor(cyls, 5), tensor(sphs, 4),
                       {k: tensor(v, 6) for k, v in attrs.items()})
    return prims, major


def _bounding_spheres(prims: Primitives) -> dict:
    b, c, s = prims.boxes, prims.cylinders, prims.spheres
    return {
        "boxes": (b[:, :3], b[:, 3:6].norm(dim=1)),
        "cylinders": (torch.stack([c[:, 0], c[:, 1], (c[:, 2] + c[:, 3]) / 2], 1),
                      torch.hypot((c[:, 3] - c[:, 2]) / 2, c[:, 4])),
        "spheres": (s[:, :3], s[:, 3]),
    }


def visible_rows(prims: Primitives, world_from_cam: torch.Tensor, tan_half: tuple) -> dict:
    """Per primitive kind, the rows whose bounding sphere can touch this camera's frustum within MAX_RANGE."""
    rotation, origin = world_from_cam[:3, :3], world_from_cam[:3, 3]
    out = {}
    for kind, (centre, radius) in _bounding_spheres(prims).items():
        local = (centre - origin) @ rotation  # camera frame
        z = local[:, 2]
        keep = (z + radius > 0.05) & (z - radius < MAX_RANGE)
        for axis, tan in ((0, tan_half[0]), (1, tan_half[1])):
            keep &= local[:, axis].abs() - radius * math.sqrt(1 + tan * tan) <= z * tan
        out[kind] = torch.nonzero(keep).flatten()
    return out


KINDS = ("boxes", "cylinders", "spheres")


def near_rows(prims: Primitives, origin: torch.Tensor, radius: float) -> dict:
    """Per kind, rows whose bounding sphere comes within `radius` of `origin` (shadow casters)."""
    return {kind: torch.nonzero((centre - origin).norm(dim=1) - size < radius).flatten()
            for kind, (centre, size) in _bounding_spheres(prims).items()}


@dataclass
class Hits:
    """Nearest hit of every ray: depth, world point, normal, class, instance, albedo, material, façade coords."""

    depth: torch.Tensor
    point: torch.Tensor
    normal: torch.Tensor
    semantic: torch.Tensor
    instance: torch.Tensor
    albedo: torch.Tensor
    material: torch.Tensor
    facade_uv: torch.Tensor


@dataclass
class Camera:
    """One camera of a frame: intrinsics K (numpy), world_from_cam (float32 tensor), and its culled rows per kind."""

    k: np.ndarray
    world_from_cam: torch.Tensor
    rows: dict


# -- primary visibility --------------------------------------------------------------------------------
# Every culled primitive of every camera is tested against the pixels of its projected bounding rectangle
# only (screen-space binning, exact: the rectangle covers the bounding sphere's projection). All (pixel,
# primitive) pairs of a frame are enumerated at once and intersected in one tensor expression per kind,
# then reduced to the nearest hit per pixel, instead of a Python loop over primitives per camera.
# The arithmetic per pair is the reference's (`raycast_reference._box_single` & co.) operation for operation
# in float32, with the per-primitive constants it computed in double precision on the host computed the
# same way and rounded the same way, so depth, semantics and instance ids are bit-identical.


def _rects(centre_cam: np.ndarray, radius: np.ndarray, k: np.ndarray, width: int, height: int) -> np.ndarray:
    """(N, 4) int64 pixel rectangles (v0, v1, u0, u1) covering bounding spheres given in the camera frame.

    Vectorised `raycast_reference.screen_rects` (same float64 arithmetic, same rounding)."""
    x, y, z = centre_cam[:, 0], centre_cam[:, 1], centre_cam[:, 2]
    behind = z - radius < 0.1
    spans = []
    for value, focal, centre, size in ((x, k[0, 0], k[0, 2], width), (y, k[1, 1], k[1, 2], height)):
        with np.errstate(divide="ignore", invalid="ignore"):
            low = np.where(value - radius <= 0, (value - radius) / (z - radius), (value - radius) / (z + radius))
            high = np.where(value + radius >= 0, (value + radius) / (z - radius), (value + radius) / (z + radius))
            first = np.floor(centre + focal * np.where(behind, 0.0, low))
            last = np.ceil(centre + focal * np.where(behind, 0.0, high))
        spans.append((np.where(behind, 0, np.maximum(first, 0)).astype(np.int64),
                      np.where(behind, size, np.minimum(last.astype(np.int64) + 1, size))))
    (u0, u1), (v0, v1) = spans
    return np.stack([v0, v1, u0, u1], 1)


_CORNERS = np.array([[sx, sy, sz] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)], np.float64)


def _box_rects(boxes: np.ndarray, world_from_cam: np.ndarray, k: np.ndarray, width: int, height: int,
               rects: np.ndarray) -> np.ndarray:
    """`rects` shrunk, for boxes wholly in front of the camera, to the bounding rectangle of their 8 projected
    corners (a box is convex, so its image lies inside; a pixel's margin on each side keeps it conservative).

    A long building's bounding sphere covers far more of the screen than the building: this is most of the
    box tests saved."""
    c, s = np.cos(boxes[:, 6]), np.sin(boxes[:, 6])
    local = _CORNERS[None] * boxes[:, None, 3:6]  # (N, 8, 3)
    world = np.stack([c[:, None] * local[..., 0] - s[:, None] * local[..., 1],
                      s[:, None] * local[..., 0] + c[:, None] * local[..., 1], local[..., 2]], -1) + boxes[:, None, :3]
    cam = (world - world_from_cam[:3, 3]) @ world_from_cam[:3, :3]
    image = cam @ k.T
    front = (cam[..., 2] > 0.1).all(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        u, v = image[..., 0] / image[..., 2], image[..., 1] / image[..., 2]
        tight = np.stack([np.floor(v.min(1)) - 1, np.ceil(v.max(1)) + 1, np.floor(u.min(1)) - 1, np.ceil(u.max(1)) + 1], 1)
    tight = np.where(front[:, None], tight, np.array([0, height, 0, width]))
    tight = np.clip(np.nan_to_num(tight), 0, [height, height, width, width]).astype(np.int64)
    return np.stack([np.maximum(rects[:, 0], tight[:, 0]), np.minimum(rects[:, 1], tight[:, 1]),
                     np.maximum(rects[:, 2], tight[:, 2]), np.minimum(rects[:, 3], tight[:, 3])], 1)


def _rect_pixels(rects: np.ndarray, camera_of: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """(pixels per rectangle (M,), pixel (P,)): every pixel of every rectangle (v0, v1, u0, u1) of camera
    camera_of[m], rectangle after rectangle, as its index in the frame's rays (camera-major). Host-side
    bookkeeping (numpy's repeat is ~20x torch's repeat_interleave here); rows first, then each row's run."""
    h = np.clip(rects[:, 1] - rects[:, 0], 0, None)
    w = np.where(h > 0, np.clip(rects[:, 3] - rects[:, 2], 0, None), 0)
    row_owner = np.repeat(np.arange(len(rects)), h)
    row_v = rects[row_owner, 0] + np.arange(len(row_owner)) - (np.cumsum(h) - h)[row_owner]
    row_pixel = camera_of[row_owner] * (width * height) + row_v * width + rects[row_owner, 2]
    row_len = w[row_owner]
    pixel = np.repeat(row_pixel - (np.cumsum(row_len) - row_len), row_len) + np.arange(int(row_len.sum()))
    return h * w, pixel


@dataclass
class _Runs:
    """Pairs grouped in runs, one per rectangle: `counts` (M,) pixels each, on `device`."""

    counts: np.ndarray
    device: torch.device


def _take(values, runs: _Runs) -> torch.Tensor:
    """Host float64 per-rectangle constants, rounded to float32 as torch rounds a Python scalar, one per pair."""
    return torch.from_numpy(np.repeat(np.asarray(values, np.float64).astype(np.float32), runs.counts)).to(runs.device)


def _box_pairs(o: np.ndarray, geometry: np.ndarray, runs: _Runs, d: list) -> torch.Tensor:
    """Ray parameter (P,) of pixel rays (d: x, y, z components (P,)) against their rectangle's box; inf if missed.

    o (M,3) and geometry (M,7) are float64 per rectangle (camera origin, box), `runs` its pixels per rectangle.
    Operation for operation `raycast_reference._box_single`."""
    cx, cy, cz, hx, hy, hz, yaw = geometry.T
    c, s = np.array([math.cos(v) for v in yaw]), np.array([math.sin(v) for v in yaw])
    rel_x, rel_y = o[:, 0] - cx, o[:, 1] - cy
    origin_local = (c * rel_x + s * rel_y, -s * rel_x + c * rel_y, o[:, 2] - cz)
    c32, s32 = _take(c, runs), _take(s, runs)
    dx, dy = d[0], d[1]
    directions = (dx * c32 + dy * s32, dy * c32 - dx * s32, d[2])
    near = far = None
    for o_axis, d_axis, half in zip(origin_local, directions, (hx, hy, hz)):
        inv = 1.0 / torch.where(d_axis.abs() < 1e-9, torch.full_like(d_axis, 1e-9), d_axis)
        t1, t2 = _take(-half - o_axis, runs) * inv, _take(half - o_axis, runs) * inv
        low, high = torch.minimum(t1, t2), torch.maximum(t1, t2)
        near = low if near is None else torch.maximum(near, low)
        far = high if far is None else torch.minimum(far, high)
    return near.masked_fill_((near > far) | (near <= 0.05), math.inf)


def _cylinder_pairs(o: np.ndarray, geometry: np.ndarray, runs: _Runs, d: list) -> torch.Tensor:
    """As `_box_pairs` for vertical cylinders (`raycast_reference._cylinder_single`)."""
    cx, cy, z0, z1, radius = geometry.T
    ox, oy = o[:, 0] - cx, o[:, 1] - cy
    dx, dy = d[0], d[1]
    a = dx * dx + dy * dy + 1e-12
    b = dx * _take(ox, runs) + dy * _take(oy, runs)
    disc = b * b - a * _take(ox * ox + oy * oy - radius * radius, runs)
    t = (-b - disc.clamp(min=0).sqrt()) / a
    z = _take(o[:, 2], runs) + t * d[2]
    return t.masked_fill_((disc <= 0) | (t <= 0.05) | (z < _take(z0, runs)) | (z > _take(z1, runs)), math.inf)


def _sphere_pairs(o: np.ndarray, geometry: np.ndarray, runs: _Runs, d: list) -> torch.Tensor:
    """As `_box_pairs` for spheres (`raycast_reference._sphere_single`)."""
    cx, cy, cz, radius = geometry.T
    rx, ry, rz = o[:, 0] - cx, o[:, 1] - cy, o[:, 2] - cz
    a = torch.stack(d, 1).square().sum(-1)
    b = d[0] * _take(rx, runs) + d[1] * _take(ry, runs) + d[2] * _take(rz, runs)
    disc = b * b - a * _take(rx * rx + ry * ry + rz * rz - radius * radius, runs)
    t = (-b - disc.clamp(min=0).sqrt()) / a
    return t.masked_fill_((disc <= 0) | (t <= 0.05), math.inf)


_PAIRS = {"boxes": _box_pairs, "cylinders": _cylinder_pairs, "spheres": _sphere_pairs}


def _kind_pairs(kind: str, prims: Primitives, cameras: list, size: tuple):
    """(pixels per rectangle, pixel, rows, origins) of one kind: every (rectangle pixel, primitive) pair of every camera.

    rows (M,) and origins (M,3, float64) are per rectangle (one per camera and culled primitive)."""
    width, height = size
    centre, radius = _bounding_spheres(prims)[kind]
    geometry = getattr(prims, kind).cpu().double().numpy()
    rects, rows, origins = [], [], []
    for camera in cameras:
        selected = camera.rows[kind]
        centre_cam = (centre[selected] - camera.world_from_cam[:3, 3]) @ camera.world_from_cam[:3, :3]
        camera_rects = _rects(centre_cam.cpu().double().numpy(), radius[selected].cpu().double().numpy(),
                              camera.k, width, height)
        if kind == "boxes":
            camera_rects = _box_rects(geometry[selected.cpu().numpy()], camera.world_from_cam.cpu().double().numpy(),
                                      camera.k, width, height, camera_rects)
        rects.append(camera_rects)
        rows.append(selected.cpu().numpy())
        origins.append(np.repeat(camera.world_from_cam[None, :3, 3].cpu().double().numpy(), len(selected), 0))
    camera_of = np.repeat(np.arange(len(cameras)), [len(c.rows[kind]) for c in cameras])
    counts, pixel = _rect_pixels(np.concatenate(rects), camera_of, width, height)
    return counts, pixel, np.concatenate(rows), np.concatenate(origins)


def cast_frame(dirs: torch.Tensor, origins: torch.Tensor, prims: Primitives, cameras: list, ground,
               size: tuple) -> tuple[Hits, dict]:
    """Nearest hits of all cameras' rays (N*H*W, 3; camera n's origin origins[n]) and per-kind visibility counts.

    counts[kind] = (pixels where the primitive is hit at all, pixels where it is the nearest hit), summed over
    cameras (pixels where it is hit at all are counted for road users only, as the reference does).
    """
    width, height = size
    device, total = dirs.device, len(prims.boxes) + len(prims.cylinders) + len(prims.spheres)
    columns = list(dirs.t().contiguous())
    ground_depth = torch.where(dirs[:, 2] < -1e-6, (-origins[:, 2:3] / dirs[:, 2].view(len(cameras), -1)
                                                    .clamp(max=-1e-6)).flatten(), torch.full_like(dirs[:, 2], math.inf))
    pixels, ids, ts, offset = [], [], [], 0
    for kind in KINDS:
        counts, pixel, rows, rect_origins = _kind_pairs(kind, prims, cameras, size)
        runs, pixel_t = _Runs(counts, device), torch.from_numpy(pixel).to(device)
        geometry = getattr(prims, kind).cpu().double().numpy()[rows]
        ts.append(_PAIRS[kind](rect_origins, geometry, runs, [c.index_select(0, pixel_t) for c in columns]))
        pixels.append(pixel_t), ids.append(torch.from_numpy(np.repeat(rows + offset, counts)).to(device))
        offset += len(getattr(prims, kind))
    pixel, gid, t = torch.cat(pixels), torch.cat(ids), torch.cat(ts)
    all_hits = torch.bincount(gid, weights=torch.isfinite(t).float(), minlength=total).float()
    depth = ground_depth.clone().scatter_reduce_(0, pixel, t, "amin")
    # the reference keeps the first primitive (kind order, then row) at the minimum, and the ground on ties
    best = (t == depth.index_select(0, pixel)) & (t < ground_depth.index_select(0, pixel))
    winner = torch.full_like(ground_depth, total, dtype=torch.long).scatter_reduce_(
        0, pixel, torch.where(best, gid, total), "amin")
    winner = torch.where(winner == total, -1, winner)
    agent = torch.cat([prims.attributes[kind][:, 1] > 0 for kind in KINDS])
    nearest = torch.bincount(winner + 1, minlength=total + 1)[1:].float()
    counts, start = {}, 0
    for kind in KINDS:
        stop = start + len(getattr(prims, kind))
        counts[kind] = ((all_hits * agent)[start:stop], nearest[start:stop])
        start = stop
    distance = torch.where(torch.isfinite(depth), depth, torch.zeros_like(depth))
    point = (origins[:, None, :] + (dirs * distance[:, None]).view(len(cameras), -1, 3)).view(-1, 3)
    return _shade_inputs(point, depth, winner, prims, ground), counts


def _shade_inputs(point, depth, winner, prims, ground) -> Hits:
    """Per-ray surface attributes of the winners (global primitive ids; -1 ground or sky).

    One gather from a table whose row 0 is the sky (class sky, instance 0) replaces per-kind masked writes."""
    normal = torch.zeros_like(point)
    normal[:, 2] = 1.0
    facade_uv = torch.zeros(len(point), 2, device=point.device)
    sky = torch.tensor([[SEG["sky"], 0, 0.0, 0.0, 0.0, 0]], device=point.device)
    table = torch.cat([sky] + [prims.attributes[kind] for kind in KINDS]).index_select(0, winner + 1)
    semantic, instance, material = table[:, 0].long(), table[:, 1].long(), table[:, 5].long()
    albedo = table[:, 2:5]
    is_ground = (winner < 0) & torch.isfinite(depth)
    semantic = torch.where(is_ground, ground.classes_at(point), semantic)
    start = 0
    for kind in KINDS:
        count = len(getattr(prims, kind))
        mine = torch.nonzero((winner >= start) & (winner < start + count)).flatten()
        geometry, p = getattr(prims, kind).index_select(0, winner.index_select(0, mine) - start), point.index_select(0, mine)
        start += count
        if not len(mine):
            continue
        if kind == "boxes":
            box_normal, uv = _box_normal(geometry, p)
            normal.index_copy_(0, mine, box_normal), facade_uv.index_copy_(0, mine, uv)
        elif kind == "cylinders":
            radial = p[:, :2] - geometry[:, :2]
            normal.index_copy_(0, mine, torch.nn.functional.pad(radial / radial.norm(dim=1, keepdim=True).clamp(min=1e-6), (0, 1)))
        else:
            normal.index_copy_(0, mine, (p - geometry[:, :3]) / geometry[:, 3:4])
    return Hits(depth, point, normal, semantic, instance, albedo, material, facade_uv)


# -- sun shadows -----------------------------------------------------------------------------------------


class _PointGrid:
    """Points (R, 2) of a plane binned in a uniform grid (counting sort by cell, on the host)."""

    MAX_CELLS = 65535
    """Cell keys fit 16 bits, so numpy's stable argsort is a radix sort."""

    def __init__(self, q_points: torch.Tensor, cell: float = 2.0):
        q = q_points.cpu().double().numpy()
        low, high = q_points.amin(0).cpu().double().numpy(), q_points.amax(0).cpu().double().numpy()
        self.low, span = low, high - low  # torch's column reductions: numpy's axis-0 ones were 5 ms a frame
        self.cell = max(cell, float(np.sqrt((span[0] + cell) * (span[1] + cell) / self.MAX_CELLS)) * 1.01)
        cells = np.floor((q - self.low) / self.cell).astype(np.int64)
        self.columns, rows = int(cells[:, 0].max()) + 1, int(cells[:, 1].max()) + 1
        key = (cells[:, 1] * self.columns + cells[:, 0]).astype(np.uint16)
        self.order = np.argsort(key, kind="stable")
        self.per_cell = np.bincount(key, minlength=self.columns * rows)
        self.first = np.cumsum(self.per_cell) - self.per_cell
        self.shape = np.array([self.columns, rows])

    def near(self, q_centre: np.ndarray, radius: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(point, disc) pairs of the points in the cells that the discs' bounding squares touch."""
        lo = np.maximum(np.floor((q_centre - radius[:, None] - self.low) / self.cell), 0).astype(np.int64)
        hi = np.minimum(np.floor((q_centre + radius[:, None] - self.low) / self.cell), self.shape - 1).astype(np.int64)
        span = np.clip(hi - lo + 1, 0, None)
        span[(span == 0).any(1)] = 0  # a disc wholly off the grid touches no cell
        row_owner = np.repeat(np.arange(len(q_centre)), span[:, 1])  # one entry per (disc, cell row)
        row = lo[row_owner, 1] + np.arange(len(row_owner)) - (np.cumsum(span[:, 1]) - span[:, 1])[row_owner]
        first_cell = row * self.columns + lo[row_owner, 0]
        # the cells of one grid row are contiguous in the sorted order: one run of points per (disc, row)
        run_start = self.first[first_cell]
        run_end = self.first[first_cell + span[row_owner, 0] - 1] + self.per_cell[first_cell + span[row_owner, 0] - 1]
        length = np.where(span[row_owner, 0] > 0, run_end - run_start, 0)
        position = np.repeat(run_start - (np.cumsum(length) - length), length) + np.arange(int(length.sum()))
        return self.order[position], np.repeat(row_owner, length)


def _box_hit_toward(origin: torch.Tensor, sun: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """bool (P,): the ray from each origin (P,3) toward the sun meets its box (P,7) (the reference's `_hit_boxes`)."""
    c, s = torch.cos(boxes[:, 6]), torch.sin(boxes[:, 6])
    rel_x, rel_y = origin[:, 0] - boxes[:, 0], origin[:, 1] - boxes[:, 1]
    o_local = torch.stack([c * rel_x + s * rel_y, -s * rel_x + c * rel_y, origin[:, 2] - boxes[:, 2]], 1)
    d_local = torch.stack([c * sun[0] + s * sun[1], -s * sun[0] + c * sun[1], sun[2].expand_as(c)], 1)
    inv = 1.0 / torch.where(d_local.abs() < 1e-9, torch.full_like(d_local, 1e-9), d_local)
    t1, t2 = (-boxes[:, 3:6] - o_local) * inv, (boxes[:, 3:6] - o_local) * inv
    near, far = torch.minimum(t1, t2).amax(1), torch.maximum(t1, t2).amin(1)
    return (near <= far) & (near > 0.05)


def _sphere_hit_toward(origin: torch.Tensor, sun: torch.Tensor, spheres: torch.Tensor) -> torch.Tensor:
    rel_x, rel_y, rel_z = (origin[:, k] - spheres[:, k] for k in range(3))
    a = (sun * sun).sum()
    b = sun[0] * rel_x + sun[1] * rel_y + sun[2] * rel_z
    cc = rel_x * rel_x + rel_y * rel_y + rel_z * rel_z - spheres[:, 3] ** 2
    disc = b * b - a * cc
    t = (-b - disc.clamp(min=0).sqrt()) / a
    return (disc > 0) & (t > 0.05)


_TOWARD = {"boxes": _box_hit_toward, "spheres": _sphere_hit_toward}


def in_shadow(points: torch.Tensor, camera_of_point: torch.Tensor, sun: torch.Tensor, prims: Primitives,
              casters: dict) -> torch.Tensor:
    """bool (R,) whether points (R, 3) see the sun (unit direction (3,)) blocked by a box or a sphere.

    casters[kind] is a (cameras, rows) bool mask: the rows that may shadow camera n's points (the reference
    culls casters per camera to those within 80 m). Shadow rays are parallel, so in a frame looking down the
    sun direction each caster covers a disc: only the points inside it (found through a grid of the points,
    all cameras at once) that lie below the caster's top along the sun get an exact ray test.
    """
    helper = torch.tensor([0.0, 0.0, 1.0] if abs(float(sun[2])) < 0.9 else [1.0, 0.0, 0.0], device=sun.device)
    e1 = torch.linalg.cross(sun, helper)
    e1 = e1 / e1.norm()
    basis = torch.stack([e1, torch.linalg.cross(sun, e1)], 1)
    blocked = torch.zeros(len(points), dtype=torch.bool, device=points.device)
    if not len(points):
        return blocked
    lifted = points + 0.02 * sun
    q_points, along_points = points @ basis, points @ sun
    grid = _PointGrid(q_points)
    spheres = _bounding_spheres(prims)
    for kind in ("boxes", "spheres"):
        rows = torch.nonzero(casters[kind].any(0)).flatten()
        if not len(rows):
            continue
        centre, radius = spheres[kind][0].index_select(0, rows), spheres[kind][1].index_select(0, rows)
        q_centre = centre @ basis
        point, disc = (torch.from_numpy(a).to(points.device) for a in grid.near(
            q_centre.cpu().double().numpy(), radius.cpu().double().numpy()))
        inside = (q_points.index_select(0, point) - q_centre.index_select(0, disc)).square().sum(1) \
            < radius.index_select(0, disc).square()
        below = (centre @ sun + radius).index_select(0, disc) > along_points.index_select(0, point)
        allowed = casters[kind][:, rows].flatten().index_select(
            0, camera_of_point.index_select(0, point) * len(rows) + disc)
        keep = torch.nonzero(inside & below & allowed).flatten()
        point = point.index_select(0, keep)
        geometry = getattr(prims, kind).index_select(0, rows.index_select(0, disc.index_select(0, keep)))
        hit = _TOWARD[kind](lifted.index_select(0, point), sun, geometry)
        blocked[point[hit]] = True
    return blocked


def _box_normal(boxes, p):
    """World normal of the face hit, and (horizontal, vertical) coordinates on it (for façade windows)."""
    c, s = torch.cos(boxes[:, 6]), torch.sin(boxes[:, 6])
    rel = p - boxes[:, :3]
    local = torch.stack([c * rel[:, 0] + s * rel[:, 1], -s * rel[:, 0] + c * rel[:, 1], rel[:, 2]], 1)
    axis = (local.abs() / boxes[:, 3:6]).argmax(dim=1)  # the face the point lies on
    sign = torch.sign(local.gather(1, axis[:, None]).squeeze(1))
    n_local = torch.zeros_like(local)
    n_local.scatter_(1, axis[:, None], sign[:, None])
    normal = torch.stack([c * n_local[:, 0] - s * n_local[:, 1], s * n_local[:, 0] + c * n_local[:, 1], n_local[:, 2]], 1)
    horizontal = torch.where(axis == 0, local[:, 1], local[:, 0])
    return normal, torch.stack([horizontal + boxes[:, 3] + boxes[:, 4], p[:, 2]], 1)
