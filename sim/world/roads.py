"""The static town of one scene: a road network around an intersection, and what stands beside it.

A scene is one intersection with three or four arms. Each arm is a road whose
centreline is integrated from a piecewise-constant curvature profile (straight
near the junction, then curves), so roads bend like real ones. Every road has
one lane per direction (right-hand traffic), a parking strip, and a sidewalk;
buildings and trees stand on the ground beyond it.

The ground is stored as a top-down raster (`GroundRaster`) of semantic classes
that the renderer looks up where a camera ray meets the ground plane: lanes,
dashed centre lines, solid edge lines, zebra crossings and stop lines are
painted into it from each cell's (arc length, signed offset) relative to the
nearest arm centreline.

All randomness comes from the `numpy.random.Generator` passed in, so a scene is
a pure function of its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.spatial import cKDTree

SEG_CLASSES = ("road", "lane_marking", "sidewalk", "building", "vegetation",
               "sky", "car", "truck", "pedestrian", "cyclist")
"""Semantic classes the world renders, by id (stored in shards; loaders map them by name)."""
SEG = {name: index for index, name in enumerate(SEG_CLASSES)}

LANE_WIDTH = 3.5
"""Width of one driving lane, metres; lanes sit at +/- LANE_WIDTH / 2 from the centreline."""
ROAD_HALF_WIDTH = 6.0
"""Centreline to kerb: one lane plus a 2.5 m parking strip."""
SIDEWALK_OUTER = 9.0
"""Centreline to the outer edge of the sidewalk."""
JUNCTION_RADIUS = 10.0
"""Arms start this far from the junction centre; vehicles turn on curves inside it."""
ARM_LENGTH = 220.0
"""Length of every arm, metres."""
POINT_SPACING = 0.25
"""Resampling step of centrelines and routes, metres."""
RASTER_CELL = 0.25
"""Edge of one ground raster cell, metres."""


@dataclass
class GroundRaster:
    """Semantic class per ground cell, plus paint brightness for markings (yellow centre lines)."""

    classes: np.ndarray
    """uint8 (H, W) SEG ids of the ground; row = y, column = x."""
    yellow: np.ndarray
    """bool (H, W) True where a marking is yellow (centre lines) rather than white."""
    origin: tuple
    """World (x, y) of cell (0, 0)'s corner."""
    cell: float = RASTER_CELL


@dataclass
class Town:
    """Static geometry of a scene."""

    arms: list
    """(P, 2) centreline polylines from the junction outward, POINT_SPACING apart."""
    ground: GroundRaster
    buildings: np.ndarray
    """(B, 7) x, y, yaw, length, width, height, colour index."""
    trees: np.ndarray
    """(T, 4) x, y, crown radius, crown height."""
    _normals: dict = field(default_factory=dict, repr=False, compare=False)

    def normals(self, arm: int) -> np.ndarray:
        """Unit left normals of arm `arm` (`arm_frames`), computed once: placing a scene's agents builds
        a thousand candidate routes, each from lanes offset along these normals."""
        if arm not in self._normals:
            self._normals[arm] = arm_frames(self.arms[arm])[1]
        return self._normals[arm]


def _integrate(heading: float, length: float, rng: np.random.Generator, start: np.ndarray) -> np.ndarray:
    """A centreline from `start`: straight for the first 25 m, then random constant-curvature pieces."""
    steps = int(length / POINT_SPACING)
    curvature = np.zeros(steps)
    position = int(25.0 / POINT_SPACING)
    while position < steps:
        piece = int(rng.uniform(30.0, 70.0) / POINT_SPACING)
        curvature[position:position + piece] = rng.choice([0.0, 1.0, -1.0]) * rng.uniform(1 / 150, 1 / 60)
        position += piece
    headings = heading + np.concatenate([[0.0], np.cumsum(curvature[:-1]) * POINT_SPACING])
    deltas = np.stack([np.cos(headings), np.sin(headings)], axis=1) * POINT_SPACING
    return start + np.concatenate([np.zeros((1, 2)), np.cumsum(deltas, axis=0)])


def make_arms(rng: np.random.Generator) -> list:
    """Three or four arms leaving the junction at roughly right angles."""
    base = rng.uniform(-math.pi, math.pi)
    headings = [base + k * math.pi / 2 + rng.uniform(-0.25, 0.25) * (k % 2) for k in range(4)]
    if rng.random() < 0.3:  # T-junction
        headings.pop(int(rng.integers(1, 4)))
    return [_integrate(h, ARM_LENGTH, rng, np.zeros(2)) for h in headings]


def arm_frames(arm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unit tangents, unit left normals) at every centreline point."""
    tangent = np.gradient(arm, axis=0)
    tangent /= np.linalg.norm(tangent, axis=1, keepdims=True)
    return tangent, np.stack([-tangent[:, 1], tangent[:, 0]], axis=1)


def _arm_coordinates(arms: list, xy: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For points `xy` (Q, 2): arc length along and signed offset from the nearest arm, and that arm's index."""
    points = np.concatenate(arms)
    owner = np.concatenate([np.full(len(a), i) for i, a in enumerate(arms)])
    arclength = np.concatenate([np.arange(len(a)) * POINT_SPACING for a in arms])
    normals = np.concatenate([arm_frames(a)[1] for a in arms])
    distance, nearest = cKDTree(points).query(xy, distance_upper_bound=SIDEWALK_OUTER + 2.0)
    far = ~np.isfinite(distance)
    nearest = np.where(far, 0, nearest)
    offset = np.einsum("qd,qd->q", xy - points[nearest], normals[nearest])
    offset[far] = 1e3
    return arclength[nearest], offset, np.where(far, -1, owner[nearest])


def _blocks_near(tree: cKDTree, low: np.ndarray, block: float, shape: tuple, reach: float) -> np.ndarray:
    """bool `shape`: is block (row, col)'s centre within `reach` of a tree point?

    Most of a town's bounding box is far from every road, so blocks are first tested GROUP x GROUP at a
    time: a group whose centre is farther than `reach` plus the distance from it to its farthest block
    centre (and a margin) holds no near block. Only the blocks of the other groups are queried, with the
    same query as before, so the mask is exactly what testing every block gives, at a fifth of the queries."""
    group = 4
    groups = (-(-shape[0] // group), -(-shape[1] // group))
    group_centres = np.stack(np.meshgrid(low[0] + (np.arange(groups[1]) + 0.5) * block * group,
                                         low[1] + (np.arange(groups[0]) + 0.5) * block * group), axis=-1).reshape(-1, 2)
    slack = (group - 1) / 2 * block * math.sqrt(2) + 0.1
    candidate = np.isfinite(tree.query(group_centres, distance_upper_bound=reach + slack)[0]).reshape(groups)
    candidate = np.repeat(np.repeat(candidate, group, 0), group, 1)[:shape[0], :shape[1]]
    rows, cols = np.nonzero(candidate)
    centres = np.stack([low[0] + (cols + 0.5) * block, low[1] + (rows + 0.5) * block], axis=1)
    near = np.zeros(shape, bool)
    near[rows, cols] = np.isfinite(tree.query(centres, distance_upper_bound=reach)[0])
    return near


def paint_ground(arms: list) -> GroundRaster:
    """Rasterise roads, markings, sidewalks and grass around the arms.

    Only cells whose 1 m block lies near a road are measured against the
    centrelines; the rest is grass.
    """
    points = np.concatenate(arms)
    low, high = points.min(axis=0) - 30.0, points.max(axis=0) + 30.0
    factor = 4
    coarse = RASTER_CELL * factor
    shape_coarse = (int(np.ceil((high[1] - low[1]) / coarse)), int(np.ceil((high[0] - low[0]) / coarse)))
    tree = cKDTree(points)
    near_road = _blocks_near(tree, low, coarse, shape_coarse, SIDEWALK_OUTER + 1.5 + coarse)
    near_road = np.repeat(np.repeat(near_road, factor, 0), factor, 1)
    rows, cols = np.nonzero(near_road)
    grid = np.stack([low[0] + (cols + 0.5) * RASTER_CELL, low[1] + (rows + 0.5) * RASTER_CELL], axis=1)
    u, d, _ = _arm_coordinates(arms, grid)
    distance = np.abs(d)
    classes = np.full(len(grid), SEG["vegetation"], np.uint8)
    classes[distance < SIDEWALK_OUTER] = SEG["sidewalk"]
    road = np.flatnonzero(distance < ROAD_HALF_WIDTH)  # every marking lies on the road: test only there
    classes[road] = SEG["road"]
    marking, centre = _markings(u[road], d[road], distance[road])
    classes[road[marking]] = SEG["lane_marking"]
    raster = np.full(near_road.shape, SEG["vegetation"], np.uint8)
    raster[rows, cols] = classes
    yellow = np.zeros(near_road.shape, bool)
    yellow[rows[road[centre]], cols[road[centre]]] = True
    return GroundRaster(raster, yellow, (float(low[0]), float(low[1])))


def _markings(u: np.ndarray, d: np.ndarray, distance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(painted, yellow centre line) for road cells at arc length `u` and signed offset `d` (`distance` = |d|)."""
    outside = u > JUNCTION_RADIUS + 5.0
    centre = outside & (distance < 0.08) & (np.mod(u, 6.0) < 3.0)
    edge = outside & (np.abs(distance - LANE_WIDTH) < 0.08)
    zebra = (u > JUNCTION_RADIUS + 0.5) & (u < JUNCTION_RADIUS + 3.5) & (distance < ROAD_HALF_WIDTH - 0.3) \
        & (np.mod(d, 1.0) < 0.5)
    stop = (np.abs(u - JUNCTION_RADIUS - 4.2) < 0.2) & (d > 0.1) & (d < LANE_WIDTH)
    return centre | edge | zebra | stop, centre


def ground_class_at(ground: GroundRaster, xy: np.ndarray) -> np.ndarray:
    """Ground class under world points (Q, 2); vegetation off the raster."""
    col = np.floor((xy[:, 0] - ground.origin[0]) / ground.cell).astype(np.int64)
    row = np.floor((xy[:, 1] - ground.origin[1]) / ground.cell).astype(np.int64)
    h, w = ground.classes.shape
    inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
    out = np.full(len(xy), SEG["vegetation"], np.uint8)
    out[inside] = ground.classes[row[inside], col[inside]]
    return out


def _footprint(x, y, yaw, length, width, samples=5) -> np.ndarray:
    a, b = np.meshgrid(np.linspace(-0.5, 0.5, samples), np.linspace(-0.5, 0.5, samples))
    local = np.stack([a.ravel() * length, b.ravel() * width], axis=1)
    c, s = math.cos(yaw), math.sin(yaw)
    return local @ np.array([[c, s], [-s, c]]) + [x, y]


def place_buildings(arms: list, ground: GroundRaster, rng: np.random.Generator) -> np.ndarray:
    """Buildings in rows along every arm, on grass only and never overlapping each other."""
    placed: list = []
    for arm in arms:
        tangent, normal = arm_frames(arm)
        u = rng.uniform(14.0, 22.0)
        while u < ARM_LENGTH - 10:
            index = int(u / POINT_SPACING)
            for side in (-1.0, 1.0):
                if rng.random() < 0.2:
                    continue
                length, width, height = rng.uniform(8, 22), rng.uniform(8, 16), rng.choice([rng.uniform(4, 9), rng.uniform(9, 30)])
                centre = arm[index] + side * normal[index] * (SIDEWALK_OUTER + rng.uniform(1.5, 5.0) + width / 2)
                yaw = math.atan2(tangent[index, 1], tangent[index, 0])
                corners = _footprint(centre[0], centre[1], yaw, length + 1.0, width + 1.0)
                if (ground_class_at(ground, corners) != SEG["vegetation"]).any():
                    continue
                if any(np.hypot(*(centre - b[:2])) < (length + b[3]) / 2 + 1.0 for b in placed):
                    continue
                placed.append(np.array([centre[0], centre[1], yaw, length, width, height, rng.integers(0, 8)]))
            u += rng.uniform(14.0, 26.0)
    return np.array(placed).reshape(-1, 7)


def place_trees(arms: list, ground: GroundRaster, buildings: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Street trees just beyond the sidewalks plus scattered ones, clear of buildings."""
    candidates = []
    for arm in arms:
        _, normal = arm_frames(arm)
        for u in np.arange(rng.uniform(15, 25), ARM_LENGTH - 5, 9.0):
            for side in (-1.0, 1.0):
                if rng.random() < 0.45:
                    index = int(u / POINT_SPACING)
                    candidates.append(arm[index] + side * normal[index] * (SIDEWALK_OUTER + 1.2))
    points = np.concatenate(arms)
    low, high = points.min(axis=0), points.max(axis=0)
    candidates.extend(rng.uniform(low, high, size=(120, 2)))
    trees = []
    for xy in candidates:
        if ground_class_at(ground, xy[None])[0] != SEG["vegetation"]:
            continue
        if len(buildings) and (np.hypot(*(buildings[:, :2] - xy).T) < np.hypot(buildings[:, 3], buildings[:, 4]) / 2 + 3).any():
            continue
        trees.append([xy[0], xy[1], rng.uniform(1.6, 3.0), rng.uniform(3.5, 5.5)])
    return np.array(trees).reshape(-1, 4)


def make_town(rng: np.random.Generator) -> Town:
    arms = make_arms(rng)
    ground = paint_ground(arms)
    buildings = place_buildings(arms, ground, rng)
    return Town(arms, ground, buildings, place_trees(arms, ground, buildings, rng))
