"""Driving clips: what the policy saw next to what it did, as one MP4 per episode.

People look at the worst episodes before any table, so a clip shows,
side by side, the front camera the policy was given and a top-down (BEV) panel
centred on the ego with its heading up: the painted ground classes of the
town's `GroundRaster`, the route, every road user's box coloured by class, the
ego's box and the plan it was following, as dots. A title strip carries the
episode and the simulated time.

Drawing is numpy (the ground: one nearest lookup of the raster per panel pixel)
plus PIL polygons, so an 80-frame clip draws in well under a second per ten
frames on one core; encoding is `stack.video.encode_h264` (PyAV's libx264,
yuv420p, so every panel size is even).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from stack.sim.world.roads import SEG, GroundRaster
from stack.sim.drive_report import write_atomic

BEV_PIXELS = 384
"""Edge of the square BEV panel, pixels (even: yuv420p halves both axes)."""
BEV_METRES = 60.0
"""Ground the BEV panel spans edge to edge, metres (30 m ahead, behind and to either side of the ego)."""
TITLE_PIXELS = 28
"""Height of the title strip above the panels."""

GROUND_RGB = {SEG["road"]: (70, 70, 76), SEG["lane_marking"]: (225, 225, 215), SEG["sidewalk"]: (150, 146, 138),
              SEG["vegetation"]: (58, 98, 44)}
"""Top-down colours of the painted ground classes (close to the renderer's albedos, brighter for a small panel)."""
YELLOW_MARKING_RGB = (235, 190, 40)
OFF_RASTER_RGB = (40, 40, 40)
AGENT_RGB = {"car": (40, 120, 255), "truck": (170, 80, 255), "pedestrian": (255, 50, 50), "cyclist": (255, 150, 0)}
"""Box fill per agent class: saturated hues that none of the ground colours are near."""
OTHER_AGENT_RGB = (255, 0, 255)
MIN_MARK_PIXELS = 4
"""Radius of the disc that marks a pedestrian-sized box, so a 0.6 m person is not a 4-pixel speck."""
EGO_RGB = (0, 230, 120)
PLAN_RGB = (255, 255, 0)
ROUTE_RGB = (150, 235, 235)
NO_CAMERA_RGB = (110, 110, 110)
CONTACT_RGB = (255, 0, 0)
"""Outline of the ego and of every box it touches, for the frames of a collision."""
LEGEND = (("car", AGENT_RGB["car"]), ("truck", AGENT_RGB["truck"]), ("pedestrian", AGENT_RGB["pedestrian"]),
          ("cyclist", AGENT_RGB["cyclist"]), ("ego", EGO_RGB), ("plan", PLAN_RGB), ("route", ROUTE_RGB))


def write_clip(path, frames: list, ground: GroundRaster, fps: float) -> Path:
    """Write the episode `frames` as an H.264 MP4 at `path` (atomically: a temp file, then os.replace).

    Each frame is a dict: "time_s"; "front" uint8 (H, W, 3) or None (a blind policy sees no camera);
    "ego" (x, y, yaw) of the box centre; "ego_size" (length, width); "agents" (A, 5) x, y, yaw, length,
    width boxes; "classes" A class names; "plan" (T, 2) world xy or None; "route" (R, 2) world xy; "title".
    """
    from stack.video import encode_h264

    if not frames:
        raise ValueError(f"write_clip({path}): no frames to write; an episode clip needs at least one")
    if not fps > 0:
        raise ValueError(f"write_clip({path}): fps must be positive, got {fps!r}")
    camera_width = _camera_panel_width(frames)
    speeds = ego_speeds(frames)
    video = np.stack([compose_frame({"speed": speed, **frame}, ground, camera_width)
                      for frame, speed in zip(frames, speeds)])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, encode_h264(video, fps))


def compose_frame(frame: dict, ground: GroundRaster, camera_width: int | None = None) -> np.ndarray:
    """uint8 (TITLE_PIXELS + BEV_PIXELS, camera_width + BEV_PIXELS, 3): title over camera | BEV."""
    if camera_width is None:
        camera_width = _camera_panel_width([frame])
    camera = camera_panel(frame.get("front"), camera_width)
    bev = bev_panel(frame, ground)
    text = f"{frame.get('title', '')}   t = {float(frame['time_s']):5.1f} s"
    if frame.get("speed") is not None:
        text += f"   v = {float(frame['speed']):4.1f} m/s"
    if contacts(_ego_box(frame), _agents(frame)).any():
        text += "   CONTACT"
    title = _title_strip(text, camera_width + BEV_PIXELS)
    return np.concatenate([title, np.concatenate([camera, bev], axis=1)], axis=0)


def ego_speeds(frames: list) -> list:
    """The ego's speed per frame (m/s) from its box centre between frames (a frame's own "speed" wins)."""
    xy = np.array([frame["ego"][:2] for frame in frames], float)
    times = np.array([frame["time_s"] for frame in frames], float)
    if len(frames) < 2:
        speeds = [None] * len(frames)
    else:
        step = np.hypot(*np.diff(xy, axis=0).T) / np.maximum(np.diff(times), 1e-9)
        speeds = list(np.r_[step[:1], step])  # the first frame takes the first interval's speed
    return [frame.get("speed", speed) for frame, speed in zip(frames, speeds)]


def _camera_panel_width(frames: list) -> int:
    """Width of the camera panel: the first front image scaled to BEV_PIXELS tall, or a square without one."""
    for frame in frames:
        front = frame.get("front")
        if front is not None:
            height, width = np.asarray(front).shape[:2]
            return _even(width * BEV_PIXELS / height)
    return BEV_PIXELS


def _even(value: float) -> int:
    return max(2, 2 * int(round(value / 2)))


def camera_panel(front, width: int) -> np.ndarray:
    """The front image nearest-upscaled to BEV_PIXELS tall, or a grey panel that says there was no camera."""
    if front is None:
        panel = Image.new("RGB", (width, BEV_PIXELS), NO_CAMERA_RGB)
        draw = ImageDraw.Draw(panel)
        text = "no camera (blind policy)"
        font = _font(16)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        draw.text(((width - right + left) / 2, (BEV_PIXELS - bottom + top) / 2), text, fill=(235, 235, 235), font=font)
        return np.asarray(panel)
    front = np.asarray(front)
    if front.dtype != np.uint8 or front.ndim != 3 or front.shape[2] != 3:
        raise ValueError(f"front camera image: expected uint8 (H, W, 3), got {front.dtype} {front.shape}")
    return np.asarray(Image.fromarray(front).resize((width, BEV_PIXELS), Image.NEAREST))


def _title_strip(text: str, width: int) -> np.ndarray:
    """The title at the left; a colour key of the BEV panel at the right, above it."""
    strip = Image.new("RGB", (width, TITLE_PIXELS), (20, 20, 20))
    draw = ImageDraw.Draw(strip)
    font = _font(15)
    draw.text((8, 5), text, fill=(240, 240, 240), font=font)
    x = width - 8
    for label, colour in reversed(LEGEND):
        x -= draw.textlength(label, font=font)
        draw.text((x, 5), label, fill=colour, font=font)
        x -= 10
    return np.asarray(strip)


def _font(size: int):
    try:
        return ImageFont.load_default(size)
    except TypeError:  # Pillow < 10.1 has one bitmap size
        return ImageFont.load_default()


def bev_panel(frame: dict, ground: GroundRaster) -> np.ndarray:
    """uint8 (BEV_PIXELS, BEV_PIXELS, 3): the ground around the ego, heading up, with route, boxes, ego and plan."""
    ego_x, ego_y, ego_yaw = (float(v) for v in frame["ego"])
    to_pixels = _world_to_pixels(ego_x, ego_y, ego_yaw)
    panel = Image.fromarray(_ground_pixels(ground, ego_x, ego_y, ego_yaw))
    draw = ImageDraw.Draw(panel)
    route = np.asarray(frame.get("route", np.zeros((0, 2))), float).reshape(-1, 2)
    route = route[np.hypot(route[:, 0] - ego_x, route[:, 1] - ego_y) < BEV_METRES]  # NaN rows drop out too
    if len(route) > 1:
        draw.line([tuple(p) for p in to_pixels(route)], fill=ROUTE_RGB, width=3)
    agents, classes, ego_box = _agents(frame), list(frame.get("classes", [])), _ego_box(frame)
    touching = contacts(ego_box, agents)
    for box, name, touches in zip(agents, classes, touching):  # absent agents (NaN boxes) fail the distance test
        if np.isfinite(box).all() and math.hypot(box[0] - ego_x, box[1] - ego_y) < BEV_METRES:
            _draw_agent(draw, to_pixels, box, AGENT_RGB.get(name, OTHER_AGENT_RGB), touches)
    draw.polygon([tuple(p) for p in to_pixels(box_corners(*ego_box))], fill=EGO_RGB,
                 outline=CONTACT_RGB if touching.any() else (0, 0, 0), width=3 if touching.any() else 1)
    plan = frame.get("plan")
    if plan is not None:
        plan = np.asarray(plan, float).reshape(-1, 2)
        for u, v in to_pixels(plan[np.isfinite(plan).all(axis=1)]):
            draw.ellipse((u - 3, v - 3, u + 3, v + 3), fill=PLAN_RGB, outline=(0, 0, 0))
    return np.asarray(panel)


def _ego_box(frame: dict) -> np.ndarray:
    return np.array([*(float(v) for v in frame["ego"][:3]), *(float(v) for v in frame["ego_size"][:2])])


def _agents(frame: dict) -> np.ndarray:
    return np.asarray(frame.get("agents", np.zeros((0, 5))), float).reshape(-1, 5)


def contacts(ego_box: np.ndarray, agents: np.ndarray) -> np.ndarray:
    """(A,) bool: which agent boxes overlap the ego's now (the metrics' own test; at fault or not)."""
    from stack.metrics.driving import boxes_overlap

    finite = np.isfinite(agents).all(axis=1)
    return finite & boxes_overlap(ego_box, np.where(finite[:, None], agents, 0.0)) if len(agents) else finite


def _draw_agent(draw: ImageDraw.ImageDraw, to_pixels, box: np.ndarray, colour: tuple, touches: bool) -> None:
    """An agent's box (outlined in CONTACT_RGB while it touches the ego); a person (under a metre) also gets a
    MIN_MARK_PIXELS disc so it shows at 6 px/m."""
    outline, line = (CONTACT_RGB, 3) if touches else ((0, 0, 0), 1)
    draw.polygon([tuple(p) for p in to_pixels(box_corners(*box))], fill=colour, outline=outline, width=line)
    if max(box[3], box[4]) < 1.0:
        (u, v), = to_pixels(box[None, :2])
        radius = MIN_MARK_PIXELS
        draw.ellipse((u - radius, v - radius, u + radius, v + radius), fill=colour, outline=outline, width=line)


def box_corners(x: float, y: float, yaw: float, length: float, width: float) -> np.ndarray:
    """(4, 2) world corners of an oriented box, counter-clockwise from front-left."""
    c, s = math.cos(yaw), math.sin(yaw)
    local = np.array([[length, width], [-length, width], [-length, -width], [length, -width]]) / 2
    return local @ np.array([[c, s], [-s, c]]) + [x, y]


def _world_to_pixels(ego_x: float, ego_y: float, ego_yaw: float):
    """World xy (K, 2) -> panel (column, row) (K, 2): ego at the centre, its heading up, its left to the left."""
    scale = BEV_PIXELS / BEV_METRES
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    centre = BEV_PIXELS / 2

    def to_pixels(xy: np.ndarray) -> np.ndarray:
        dx, dy = xy[:, 0] - ego_x, xy[:, 1] - ego_y
        forward, left = dx * c + dy * s, -dx * s + dy * c
        return np.stack([centre - left * scale, centre - forward * scale], axis=1)

    return to_pixels


def _ground_pixels(ground: GroundRaster, ego_x: float, ego_y: float, ego_yaw: float) -> np.ndarray:
    """The ground raster's colours sampled (nearest cell) at every panel pixel centre."""
    scale = BEV_METRES / BEV_PIXELS
    offsets = (np.arange(BEV_PIXELS) + 0.5 - BEV_PIXELS / 2) * scale
    forward = -offsets[:, None]  # row 0 is the farthest ahead
    left = -offsets[None, :]  # column 0 is the farthest left
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    x = ego_x + forward * c - left * s
    y = ego_y + forward * s + left * c
    col = np.floor((x - ground.origin[0]) / ground.cell).astype(np.int64)
    row = np.floor((y - ground.origin[1]) / ground.cell).astype(np.int64)
    height, width = ground.classes.shape
    inside = (row >= 0) & (row < height) & (col >= 0) & (col < width)
    row, col = np.where(inside, row, 0), np.where(inside, col, 0)
    pixels = _ground_palette()[ground.classes[row, col]]
    pixels[ground.yellow[row, col]] = YELLOW_MARKING_RGB
    pixels[~inside] = OFF_RASTER_RGB
    return pixels


def _ground_palette() -> np.ndarray:
    palette = np.full((256, 3), OFF_RASTER_RGB, np.uint8)
    for cls, rgb in GROUND_RGB.items():
        palette[cls] = rgb
    return palette
