"""The one pipeline definition: a typed tree that every stage receives.

`Pipeline` is the schema. `stack.config.load_pipeline` merges YAML files and
`key=value` overrides onto it and returns a validated instance; only that object
moves between stages (data → model → train → export → deploy), and every artifact
carries its resolved YAML (`to_yaml`) so it can be rebuilt and audited.

Every field has an attribute docstring: `stack config --describe KEY` prints them,
and error messages quote them. Range and choice checks live in each section's
`problems()` method, which returns (field, message) pairs instead of raising, so a
bad config reports all of its mistakes at once, each under its full dotted key.

This module imports no stage and nothing heavier than the standard library.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from stack import safe_values

SCHEMA_VERSION = 1
"""Bumped whenever a field is renamed or its meaning changes; artifacts record it."""

Problems = List[tuple]  # (field name, what is wrong and what is allowed)


def _choice(problems: Problems, name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        problems.append((name, f"got {value!r}; allowed: {', '.join(allowed)}"))


def _positive(problems: Problems, name: str, value: float) -> None:
    if not value > 0:
        problems.append((name, f"got {value!r}; must be > 0"))


def _in_range(problems: Problems, name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        problems.append((name, f"got {value!r}; must be between {low} and {high}"))


def _at_most(problems: Problems, name: str, value: float, high: float, why: str) -> None:
    """Refuse a count or size past what any run could use. Such a value is a typo (an extra digit, a byte count,
    a unit slip) that would otherwise start days of work or ask for memory no machine has, and fail far from
    the key that caused it, or never."""
    if value > high:
        problems.append((name, f"got {_number(value)}; at most {_number(high)} {why}"))


def _number(value: float) -> str:
    """A count as typed (`65537`), a float without a trailing `.0` (`101`, `1e+12`)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounded(problems: Problems, section, bounds: tuple) -> None:
    """`_at_most` for each (field, bound, why) of a section's table of upper bounds."""
    for name, high, why in bounds:
        value = getattr(section, name)
        _at_most(problems, name, len(value) if isinstance(value, (list, dict)) else value, high, why)


def _increasing(problems: Problems, name: str, values: List[float], count: int) -> None:
    if len(values) != count or any(b <= a for a, b in zip(values, values[1:])):
        problems.append((name, f"got {list(values)!r}; expected {count} increasing numbers"))


# --------------------------------------------------------------------------- data


@dataclass
class Camera:
    """One camera of the rig: a pinhole model mounted on the ego vehicle.

    The ego frame is x forward, y left, z up, origin on the ground below the rear
    axle (nuScenes convention). The camera frame is x right, y down, z forward.
    """

    name: str = "front"
    """Unique name; shard keys and reports use it (e.g. `front.jpg`)."""
    x: float = 1.5
    """Mount position along ego x (forward), metres."""
    y: float = 0.0
    """Mount position along ego y (left), metres."""
    z: float = 1.6
    """Mount height above the ground, metres."""
    yaw_deg: float = 0.0
    """Heading of the optical axis, degrees counter-clockwise from ego x (0 = forward, 90 = left)."""
    pitch_deg: float = 0.0
    """Tilt of the optical axis, degrees; positive looks down."""
    hfov_deg: float = 70.0
    """Horizontal field of view, degrees; the focal length follows from it and the image width."""

    def problems(self) -> Problems:
        found: Problems = []
        _in_range(found, "hfov_deg", self.hfov_deg, 10.0, 170.0)
        _in_range(found, "pitch_deg", self.pitch_deg, -60.0, 60.0)
        _positive(found, "z", self.z)
        return found


def _surround_rig() -> List[Camera]:
    """Six surround cameras laid out like nuScenes' CAM_FRONT ... CAM_BACK_RIGHT."""
    return [
        Camera(name="front", x=1.7, y=0.0, yaw_deg=0.0, hfov_deg=70.0),
        Camera(name="front_left", x=1.5, y=0.5, yaw_deg=55.0, hfov_deg=70.0),
        Camera(name="front_right", x=1.5, y=-0.5, yaw_deg=-55.0, hfov_deg=70.0),
        Camera(name="back", x=-0.5, y=0.0, yaw_deg=180.0, hfov_deg=110.0),
        Camera(name="back_left", x=0.0, y=0.5, yaw_deg=110.0, hfov_deg=70.0),
        Camera(name="back_right", x=0.0, y=-0.5, yaw_deg=-110.0, hfov_deg=70.0),
    ]


MAX_IMAGE_SIDE = 8192
"""Largest data.rig image width or height: 8K pixels, past any automotive camera (nuScenes: 1600x900)."""
MAX_CAMERAS = 32
"""Most cameras in a rig (surround rigs have 6-12): each is a backbone pass per sample."""

@dataclass
class RigConfig:
    """The camera rig: every camera shares one image size."""

    image_width: int = 704
    """Image width in pixels, for every camera."""
    image_height: int = 256
    """Image height in pixels, for every camera."""
    cameras: List[Camera] = field(default_factory=_surround_rig)
    """The cameras, in the order the model sees them."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("image_width", "image_height"):
            value = getattr(self, name)
            if value < 16 or value % 8:
                found.append((name, f"got {value}; must be a multiple of 8 and at least 16"))
        if not self.cameras:
            found.append(("cameras", "got an empty list; the rig needs at least one camera"))
        _bounded(found, self, (
            ("image_width", MAX_IMAGE_SIDE, "pixels (8K, past any automotive camera); e.g. 704"),
            ("image_height", MAX_IMAGE_SIDE, "pixels (8K, past any automotive camera); e.g. 256"),
            ("cameras", MAX_CAMERAS, "cameras (surround rigs have 6-12; each is a backbone pass per sample)")))
        names = [c.name for c in self.cameras]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            found.append(("cameras", f"camera names must be unique; repeated: {', '.join(duplicates)}"))
        return found


AGENT_CLASS_MIX = {"car": 0.5, "truck": 0.1, "pedestrian": 0.28, "cyclist": 0.12}
"""The world's road-user classes and their default frequencies (roughly nuScenes' proportions)."""


@dataclass
class WorldConfig:
    """The procedural driving world that `stack data make` renders."""

    seed: int = 0
    """Master seed: the same config and seed give byte-identical shards."""
    scenes: int = 40
    """Number of independent scenes (towns and traffic) to render."""
    frames_per_scene: int = 40
    """Key frames rendered per scene."""
    frame_rate_hz: float = 2.0
    """Key frames per second (nuScenes annotates at 2 Hz)."""
    agents_per_scene: int = 24
    """Other road users (cars, trucks, pedestrians, cyclists) placed per scene."""
    spawn_radius_m: float = 70.0
    """Agents start within this distance of the ego; smaller keeps them near, and large in the images."""
    class_mix: Dict[str, float] = field(default_factory=lambda: dict(AGENT_CLASS_MIX))
    """Relative frequency of each agent class (normalised); raise rare classes to balance a small dataset."""
    val_fraction: float = 0.2
    """Fraction of scenes written to the validation split (whole scenes, never frames)."""
    workers: int = 2
    """Render processes (one torch thread each); scenes are rendered in parallel."""
    render_device: str = "auto"
    """Where rays are cast: `auto` (CUDA when available), `cpu` or `cuda`."""
    drive_episodes: int = 0
    """Closed-loop training episodes of the scenario families (`drive.scenarios`, at training seeds, never
    the evaluation ones) driven by the expert with injected noise; every replanning instant is written to the
    train split with the expert's plan from there as its planning target (recovery data, stack.sim.recording).
    0: the recorded scenes only. Needs the frames layout."""
    expert_sees: str = "everyone"
    """Whom the expert that drives and labels those episodes (and labels DAgger's states) reacts to: `everyone`
    (privileged: every road user, hidden or not) or `cameras` (only road users that have had a visible pixel in
    some camera in the episode so far, the rule the detector's labels follow): a teacher that brakes for a pedestrian no
    camera shows asks the student for what it cannot learn (LEAD, Nguyen et al. 2025). The baseline
    `expert` policy of `stack drive` stays privileged."""

    def problems(self) -> Problems:
        found: Problems = []
        _in_range(found, "drive_episodes", self.drive_episodes, 0, 100_000)
        _choice(found, "expert_sees", self.expert_sees, ("everyone", "cameras"))
        _bounded(found, self, (
            ("scenes", 100_000, "scenes (a million rendered frames and more); e.g. 40"),
            ("frames_per_scene", 10_000, "frames per scene (over an hour at 2 Hz; scenes last seconds); e.g. 40"),
            ("frame_rate_hz", 100.0, "Hz (cameras run at 10-30 Hz; nuScenes annotates at 2 Hz); e.g. 2"),
            ("agents_per_scene", 1_000, "road users per scene (a junction holds tens); e.g. 24"),
            ("spawn_radius_m", 1_000.0, "m (the BEV grid sees 50 m around the ego); e.g. 70")))
        for name in ("scenes", "frames_per_scene", "frame_rate_hz", "spawn_radius_m"):
            _positive(found, name, getattr(self, name))
        unknown = sorted(set(self.class_mix) - set(AGENT_CLASS_MIX))
        if unknown or not self.class_mix or min(self.class_mix.values()) < 0 or sum(self.class_mix.values()) <= 0:
            found.append(("class_mix", f"got {dict(self.class_mix)}; expected non-negative weights, not all zero, "
                          f"for classes among {list(AGENT_CLASS_MIX)}"))
        if self.agents_per_scene < 0:
            found.append(("agents_per_scene", f"got {self.agents_per_scene}; must be >= 0"))
        _in_range(found, "val_fraction", self.val_fraction, 0.0, 0.9)
        _in_range(found, "workers", self.workers, 0, 64)
        _choice(found, "render_device", self.render_device, ("auto", "cpu", "cuda"))
        return found


@dataclass
class AugmentConfig:
    """Training-time augmentation; every transform keeps labels consistent."""

    enabled: bool = True
    """Master switch; evaluation and export never augment."""
    resize_scale: List[float] = field(default_factory=lambda: [0.9, 1.1])
    """Random image rescale range [low, high]; intrinsics are updated to match."""
    bev_rotate_deg: float = 5.0
    """Random yaw of the whole BEV scene, +/- degrees: boxes, their velocities, the camera poses and the ego's past and
    future trajectories rotate with it, and the planner is given the angle (Batch.bev_rotation; data/augment.py)."""
    color_jitter: float = 0.1
    """Brightness/contrast/saturation jitter strength, 0 disables."""

    def problems(self) -> Problems:
        found: Problems = []
        _increasing(found, "resize_scale", self.resize_scale, 2)
        if self.resize_scale and min(self.resize_scale) <= 0:
            found.append(("resize_scale", f"got {list(self.resize_scale)!r}; scales must be > 0"))
        _in_range(found, "bev_rotate_deg", self.bev_rotate_deg, 0.0, 180.0)
        _in_range(found, "color_jitter", self.color_jitter, 0.0, 1.0)
        return found


DATA_BACKENDS = ("torch", "dali")
SHARD_LAYOUTS = ("frames", "clips")
MAX_BATCH_SIZE = 65_536
"""Largest data.batch_size: 65,536 samples of six 704x256 cameras are ~200 GB of images before the network
sees them, past any GPU's memory, so a larger value is a typo (an extra digit, a byte count)."""


@dataclass
class DataConfig:
    """Where samples come from and how they are loaded."""

    root: str = "runs/data"
    """Folder that holds the shards (`train/`, `val/`) and their index files."""
    aggregate: List[str] = field(default_factory=list)
    """More datasets whose train splits are trained on beside data.root's (DAgger's recorded iterations,
    `stack dagger`); each has the cameras, image size and layout of data.root. Validation stays data.root's."""
    layout: str = "frames"
    """Shard layout: `frames` (JPEG per camera per sample) or `clips` (H.264 MP4 per camera per clip)."""
    backend: str = "torch"
    """Loader: `torch` (WebDataset + DataLoader) or `dali` (NVIDIA DALI; CPU decode without a GPU)."""
    batch_size: int = 4
    """Samples per batch on each rank (1 to MAX_BATCH_SIZE, 65,536: a batch past any accelerator's memory
    is refused as a typo)."""
    num_workers: int = 2
    """Loader worker processes (torch) or threads (DALI) per rank."""
    samples_per_shard: int = 64
    """Samples written to each `.tar` shard."""
    jpeg_quality: int = 90
    """JPEG quality of the camera images in frame shards."""
    skip_bad_samples: bool = False
    """Skip (and count) corrupt samples instead of stopping with an error."""
    rig: RigConfig = field(default_factory=RigConfig)
    """The camera rig that renders (and is assumed by) the data."""
    world: WorldConfig = field(default_factory=WorldConfig)
    """The procedural world generator."""
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    """Training-time augmentation."""

    def problems(self) -> Problems:
        found: Problems = []
        _choice(found, "layout", self.layout, SHARD_LAYOUTS)
        _choice(found, "backend", self.backend, DATA_BACKENDS)
        _positive(found, "batch_size", self.batch_size)
        _bounded(found, self, (
            ("batch_size", MAX_BATCH_SIZE, "samples per rank (more images than any GPU holds); e.g. 4 on a CPU, "
                                           "8-64 on a GPU"),
            ("samples_per_shard", 100_000, "samples per shard (a shard is one worker's unit of reading; "
                                           "WebDataset shards hold hundreds); e.g. 64")))
        _positive(found, "samples_per_shard", self.samples_per_shard)
        _in_range(found, "num_workers", self.num_workers, 0, 64)
        _in_range(found, "jpeg_quality", self.jpeg_quality, 1, 100)
        if self.layout == "clips" and self.world.drive_episodes > 0:
            found.append(("world.drive_episodes", f"got {self.world.drive_episodes} with layout clips: closed-loop "
                                                  f"training frames are written as frames shards; set data.layout=frames "
                                                  f"or data.world.drive_episodes=0"))
        return found


# -------------------------------------------------------------------------- model


MAX_BEV_CELLS = 2048
"""Most BEV cells along x or y (range / cell_size): 2048^2 cells x 64 channels is 1 GB per sample in fp32."""


@dataclass
class BevGridConfig:
    """The bird's-eye-view grid around the ego vehicle (ego frame, metres)."""

    x_range: List[float] = field(default_factory=lambda: [-51.2, 51.2])
    """[min, max] along ego x (forward)."""
    y_range: List[float] = field(default_factory=lambda: [-51.2, 51.2])
    """[min, max] along ego y (left)."""
    z_range: List[float] = field(default_factory=lambda: [-2.0, 4.0])
    """[min, max] height; points outside are dropped, the rest collapse into one cell."""
    cell_size: float = 0.8
    """Cell edge length, metres (102.4 m / 0.8 m = 128 cells)."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("x_range", "y_range", "z_range"):
            _increasing(found, name, getattr(self, name), 2)
        _positive(found, "cell_size", self.cell_size)
        if self.cell_size > 0 and not found:
            for name in ("x_range", "y_range"):
                low, high = getattr(self, name)
                cells = (high - low) / self.cell_size
                if cells > MAX_BEV_CELLS:
                    found.append((name, f"got {[low, high]} at cell_size {self.cell_size:g}: {cells:.0f} cells; at "
                                        f"most {MAX_BEV_CELLS} (range / cell_size; 2048 x 2048 cells are 1 GB of BEV "
                                        f"features per sample); use a larger cell_size or a shorter range"))
        return found


@dataclass
class DepthBinsConfig:
    """Discrete depth bins of the lift step (BEVDepth-style classification)."""

    min_m: float = 1.0
    """Depth of the first bin's lower edge, metres."""
    max_m: float = 49.0
    """Depth of the last bin's upper edge, metres."""
    bins: int = 48
    """Number of uniform bins between min_m and max_m."""

    def problems(self) -> Problems:
        found: Problems = []
        _positive(found, "min_m", self.min_m)
        if self.max_m <= self.min_m:
            found.append(("max_m", f"got {self.max_m}; must be greater than min_m ({self.min_m})"))
        _in_range(found, "bins", self.bins, 2, 512)
        return found


@dataclass
class LossWeights:
    """Weight of each task's loss in the total."""

    detection: float = 1.0
    """CenterPoint heatmap focal loss + box regression L1."""
    depth: float = 1.0
    """Depth-bin cross entropy against the rendered metric depth."""
    segmentation: float = 1.0
    """Per-pixel semantic cross entropy."""
    planning: float = 1.0
    """Winner-takes-all L2 + mode classification + collision term."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("detection", "depth", "segmentation", "planning"):
            value = getattr(self, name)
            if value < 0:
                found.append((name, f"got {value}; loss weights must be >= 0"))
        return found


DETECTION_CLASSES = ["car", "truck", "pedestrian", "cyclist"]
SEGMENTATION_CLASSES = [
    "road", "lane_marking", "sidewalk", "building", "vegetation",
    "sky", "car", "truck", "pedestrian", "cyclist",
]


CIRCLE_NMS_MAX_M = 20.0
"""Largest circle-NMS radius: beyond a bus's length a radius would merge distinct road users."""

MODEL_BOUNDS = (
    ("neck_channels", 4096, "channels (ResNet-50's widest stage has 2048); e.g. 64"),
    ("bev_channels", 4096, "channels (BEV encoders use 64-512); e.g. 64"),
    ("planning_width", 4096, "channels (0: bev_channels); e.g. 0"),
    ("max_boxes", 10_000, "boxes per sample (a junction holds tens of road users); e.g. 64"),
    ("planning_modes", 256, "candidate trajectories (planners propose 6-256); e.g. 6"),
    ("planning_steps", 100, "waypoints (50 s at 0.5 s steps; planners look 3-8 s ahead); e.g. 6"),
    ("planning_layers", 64, "attention layers; e.g. 2"),
    ("planning_accelerations", 256, "accelerations (the path-speed planner scores each one); e.g. 15"),
    ("path_points", 1024, "path points; e.g. 16"),
    ("detection_classes", 256, "classes; e.g. the 4 of the rendered world"),
    ("segmentation_classes", 255, "classes (semantic ids are stored as uint8, 255 marks no label)"),
)
"""Upper bounds of ModelConfig's sizes: (field, bound, why)."""


@dataclass
class ModelConfig:
    """The multi-task network: image backbone, depth/seg heads, lift-splat, BEV heads, planner."""

    backbone: str = "resnet18"
    """timm model name, built with `features_only=True` and no download."""
    backbone_checkpoint: Optional[str] = None
    """Local path to backbone weights (no model hub is reachable); null trains from scratch."""
    neck_channels: int = 64
    """FPN output width, also the context width lifted into BEV."""
    feature_stride: int = 16
    """Stride of the image features that are lifted (image size / stride = feature size)."""
    bev_channels: int = 64
    """Width of the BEV encoder."""
    bev: BevGridConfig = field(default_factory=BevGridConfig)
    """The BEV grid."""
    depth: DepthBinsConfig = field(default_factory=DepthBinsConfig)
    """Depth bins of the lift step."""
    detection_classes: List[str] = field(default_factory=lambda: list(DETECTION_CLASSES))
    """3D detection classes, in heatmap channel order."""
    segmentation_classes: List[str] = field(default_factory=lambda: list(SEGMENTATION_CLASSES))
    """Semantic classes, in logit order."""
    max_boxes: int = 64
    """Boxes kept per sample after decoding (and padded to in batches)."""
    planning_modes: int = 6
    """Candidate trajectories (K) the planner proposes."""
    planning_steps: int = 6
    """Future waypoints (T) per trajectory, at 0.5 s steps (6 = 3 s)."""
    planning_width: int = 0
    """Width of the planning head's queries and attention; the BEV tokens are projected to it. 0: bev_channels
    (no projection)."""
    planning_layers: int = 2
    """Cross-attention layers of the planning head."""
    planning_accelerations: List[float] = field(default_factory=list)
    """Empty: the planner regresses `planning_modes` trajectories as residuals on the ego rollout. Otherwise the
    path-speed planner (`stack.models.path_speed_head`): one path, and one candidate per constant acceleration
    (m/s^2) along it, scored for imitation and collision; the plan then has len(planning_accelerations) candidates."""
    planning_collision_weight: float = 1.0
    """w in the path-speed planner's score log p(expert) + w log p(no collision): above 1, a candidate the
    scorer doubts is given up for a slower one sooner."""
    temporal_frames: int = 0
    """Previous key frames fused into the BEV (BEVDet4D, Huang & Huang 2022): 0, one frame (today's network), or
    1: the key frame 0.5 s earlier is lifted by the same network (no gradient, as BEVDet4D trains it), warped into
    the current ego frame by the ego motion and concatenated before the BEV encoder, so the heads see how things
    moved. The torch loader reads it from the shards (`stack.data.sequences`); the closed loop carries it as state."""
    path_points: int = 16
    """Points of the path-speed planner's path (one every path_spacing_m, from the ego)."""
    path_spacing_m: float = 2.5
    """Metres between the path-speed planner's path points."""
    loss_weights: LossWeights = field(default_factory=LossWeights)
    """Per-task loss weights."""
    segmentation_stride: int = 8
    """Stride of the segmentation logits (image size / stride); at most feature_stride."""
    score_threshold: float = 0.1
    """Detections scoring below this are dropped by the box decoder."""
    nms_iou: float = 0.2
    """Bird's-eye-view IoU above which the decoder suppresses the lower-scoring box of a class."""
    circle_nms_radius_m: Dict[str, float] = field(default_factory=dict)
    """Empty: IoU NMS (nms_iou). Otherwise CenterPoint's circle NMS instead, a radius in metres for every detection
    class: a box suppresses the lower-scoring boxes of its class whose BEV centres lie within it
    (`stack.models.decoders.circle_nms`). CenterPoint's nuScenes radii: car 2, truck 3.46, pedestrian 0.42, bicycle
    0.92 (its `min_radius` values are these squared)."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("neck_channels", "bev_channels", "max_boxes", "planning_modes", "planning_steps",
                     "planning_layers"):
            _positive(found, name, getattr(self, name))
        _bounded(found, self, MODEL_BOUNDS)
        if self.planning_accelerations:
            _positive(found, "path_points", self.path_points)
            if not self.path_spacing_m > 0:
                found.append(("path_spacing_m", f"got {self.path_spacing_m}; must be a positive number of metres"))
            bad = [a for a in self.planning_accelerations if not -12.0 <= a <= 6.0]
            if bad or len(set(self.planning_accelerations)) != len(self.planning_accelerations):
                found.append(("planning_accelerations", f"got {list(self.planning_accelerations)}; give distinct "
                                                        f"accelerations in m/s^2 within [-12, 6] (a car's range)"))
            if not self.planning_collision_weight >= 0:
                found.append(("planning_collision_weight", f"got {self.planning_collision_weight}; must be >= 0"))
            if self.planning_modes != 1:
                found.append(("planning_modes", f"got {self.planning_modes} with planning_accelerations set; the "
                                                f"path-speed planner plans one path: set planning_modes: 1"))
        _in_range(found, "temporal_frames", self.temporal_frames, 0, 1)
        if self.planning_width < 0 or self.planning_width % 4:
            found.append(("planning_width", f"got {self.planning_width}; use 0 (bev_channels) or a positive multiple "
                                            f"of 4 (the planner's attention heads)"))
        _choice(found, "feature_stride", self.feature_stride, (4, 8, 16, 32))
        _choice(found, "segmentation_stride", self.segmentation_stride, (4, 8, 16, 32))
        if self.segmentation_stride > self.feature_stride:
            found.append(("segmentation_stride", f"got {self.segmentation_stride}; must be <= feature_stride "
                                                 f"({self.feature_stride})"))
        if self.bev_channels % 4:
            found.append(("bev_channels", f"got {self.bev_channels}; must be a multiple of 4 (planning attention heads)"))
        _in_range(found, "score_threshold", self.score_threshold, 0.0, 1.0)
        _in_range(found, "nms_iou", self.nms_iou, 0.0, 1.0)
        self._check_circle_nms(found)
        if not self.backbone:
            found.append(("backbone", "got an empty name; give a timm model name such as resnet18"))
        if not self.detection_classes:
            found.append(("detection_classes", "got an empty list; name at least one class"))
        if not self.segmentation_classes:
            found.append(("segmentation_classes", "got an empty list; name at least one class"))
        return found

    def _check_circle_nms(self, found: Problems) -> None:
        """Circle NMS needs one finite radius, 0 to CIRCLE_NMS_MAX_M, for each detection class and no other name."""
        radii = dict(self.circle_nms_radius_m)
        if not radii:
            return
        missing, unknown = sorted(set(self.detection_classes) - set(radii)), sorted(set(radii) - set(self.detection_classes))
        bad = {name: value for name, value in radii.items() if not 0.0 <= value <= CIRCLE_NMS_MAX_M}
        if missing or unknown or bad:
            found.append(("circle_nms_radius_m", f"got {radii}; give a radius in metres (0 to {CIRCLE_NMS_MAX_M:g}) "
                          f"for each of {list(self.detection_classes)}"
                          + (f"; missing {missing}" if missing else "") + (f"; unknown {unknown}" if unknown else "")
                          + ", or {} for IoU NMS"))


# -------------------------------------------------------------------------- train

STRATEGIES = ("auto", "ddp", "fsdp")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
ACCELERATORS = ("auto", "cpu", "gpu")
LAUNCHERS = ("local", "slurm", "torchrun")
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""URI schemes train.tracking_uri accepts (MLflow's tracking stores; `+driver` suffixes allowed)."""
TRACKING_OFF = ("off", "false", "no", "none")
"""Spellings of train.tracking_uri that turn tracking off; the schema keeps `off`."""
TRACKING_FILES = (".db", ".sqlite", ".sqlite3")
"""Endings of a path train.tracking_uri names as a SQLite store (a bare word is a typo, not a store in the cwd)."""


MAX_STEPS = 1_000_000_000
"""Most optimizer steps any step count may name (a billion: years of training at several steps a second)."""
TRAIN_BOUNDS = (
    ("max_epochs", 1_000_000, "epochs (bound a long run with max_steps); e.g. 20"),
    ("max_steps", MAX_STEPS, "steps (years of training); e.g. 2000, or -1 for no bound"),
    ("warmup_steps", MAX_STEPS, "steps; e.g. 50"),
    ("checkpoint_every_n_steps", MAX_STEPS, "steps; e.g. 200"),
    ("log_every_n_steps", MAX_STEPS, "steps; e.g. 10"),
    ("devices", 1024, "processes per node (a node holds up to 8-16 GPUs); e.g. 8"),
    ("num_nodes", 100_000, "nodes (more than any cluster); e.g. 4"),
    ("keep_checkpoints", 10_000, "checkpoints (each is the whole training state on disk); e.g. 2"),
    ("profile_steps", 1_000, "steps (the Chrome trace of a few steps is already large); e.g. 6"),
    ("slurm_signal_seconds", 65_535, "s (sbatch --signal takes at most 65535 seconds); e.g. 300"),
    ("slurm_cpus_per_task", 4_096, "CPUs per rank (more than any node holds); e.g. 8"),
)
"""Upper bounds of TrainConfig's counts: (field, bound, why)."""


@dataclass
class TrainConfig:
    """How `stack train` fits the model (Lightning)."""

    out_dir: str = "runs/train"
    """Folder for checkpoints, logs and the resolved pipeline."""
    seed: int = 0
    """Seed for weights, data order and augmentation."""
    max_epochs: int = 20
    """Upper bound on epochs."""
    max_steps: int = -1
    """Upper bound on optimizer steps; -1 means no bound (epochs decide)."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 50
    """Linear warm-up steps before cosine decay."""
    grad_clip: float = 5.0
    """Gradient-norm clip; 0 disables."""
    accelerator: str = "auto"
    """`auto`, `cpu` or `gpu`."""
    devices: int = 1
    """Processes (GPUs, or CPU ranks) per node."""
    num_nodes: int = 1
    """Nodes in the job."""
    strategy: str = "auto"
    """`auto`, `ddp`, or `fsdp` (FSDP2 `fully_shard`)."""
    precision: str = "bf16-mixed"
    """`32-true`, `bf16-mixed` or `16-mixed`."""
    activation_checkpointing: List[str] = field(default_factory=list)
    """Module groups to recompute in backward (e.g. `backbone`, `bev_encoder`)."""
    compile: bool = False
    """Wrap the model in `torch.compile` (slow to compile on small CPUs)."""
    checkpoint_every_n_steps: int = 200
    """Write a resumable checkpoint every N optimizer steps."""
    resume: Optional[str] = None
    """Checkpoint to resume from (a `.ckpt` file, a sharded checkpoint folder, or a run's out_dir
    to take its latest checkpoint); null starts fresh."""
    overwrite: bool = False
    """Start fresh in an out_dir that already holds a run (model.pt or checkpoints), deleting that
    run's checkpoints, weights and logs. Without it such an out_dir is refused unless train.resume is set."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    fsdp_units: List[str] = field(default_factory=lambda: ["*"])
    """FSDP2 sharding policy: module-name patterns, one `.`-separated glob per level, each match
    sharded as its own unit (`*` = every top-level part, `backbone.*` = each backbone stage,
    `backbone.*.*` = each block); the whole model is the outer unit."""
    fsdp_replicate: str = "auto"
    """FSDP2 hybrid sharding (HSDP): how many replicas of the sharded model; each shards it over
    (num_nodes x devices) / fsdp_replicate ranks. `auto` = one replica per node (shard within a
    node, replicate across nodes); `1` = shard over every rank (plain FSDP)."""
    fsdp_cpu_offload: bool = False
    """FSDP2 on GPUs: keep parameter shards, gradients and optimizer state in host memory
    (`CPUOffloadPolicy`; the optimizer step runs on the CPU). Refused on CPU ranks."""
    launcher: str = "local"
    """`local` (this machine; Lightning starts the ranks), `slurm` (write an sbatch script that
    runs the same command under srun, and submit it) or `torchrun` (multi-node rendezvous)."""
    rendezvous: str = "localhost:29500"
    """host:port of the torchrun rendezvous (launcher=torchrun): run the same command on every node."""
    slurm_partition: str = ""
    """SLURM partition for launcher=slurm; empty uses the cluster's default."""
    slurm_time: str = "04:00:00"
    """SLURM wall-time limit for launcher=slurm: HH:MM:SS, D-HH:MM:SS, MM (sbatch --time forms)."""
    slurm_extra: List[str] = field(default_factory=list)
    """Extra `#SBATCH` options for launcher=slurm, e.g. `--account=perception`."""
    slurm_requeue: bool = True
    """launcher=slurm: `--requeue` and `--signal=USR1@slurm_signal_seconds`; on that signal (or SIGTERM from
    preemption) training checkpoints at the step's end and requeues, and the requeued job resumes by itself."""
    slurm_signal_seconds: int = 300
    """Seconds before the time limit that SLURM signals the job (room for one checkpoint; SLURM may signal up to 60 s early)."""
    slurm_cpus_per_task: int = 0
    """`--cpus-per-task` for each rank (data-loading workers need them); 0 leaves it to the cluster."""
    slurm_mem: str = ""
    """`--mem` per node: a count with an optional K/M/G/T suffix (megabytes without), e.g. 256G; empty leaves it to the cluster."""
    slurm_container_image: str = ""
    """Container image the ranks run in (pyxis/enroot `srun --container-image`: `nvcr.io#nvidia/pytorch:24.05-py3`
    or a `.sqsh` path); it must have `stack` installed (`python -m stack`). Empty runs on the host."""
    slurm_container_mounts: List[str] = field(default_factory=list)
    """`SRC[:DST[:FLAGS]]` mounts into the container (pyxis `--container-mounts`), e.g. `/data:/data:ro`; mount the
    working folder, data.root and train.out_dir at the same paths."""
    log_every_n_steps: int = 10
    """Steps between metric log rows (TensorBoard, CSV, progress bar)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s used for MFU; 0 measures it once per run with a matmul at the training precision."""
    count_comm_bytes: bool = False
    """On more than one rank, log `perf/comm_sent_mb` (bytes this rank sends in collectives, `stack.train.comm`).
    Off by default: counting wraps torch.distributed's collectives and replaces DDP's C++ all-reduce with the
    Python default comm hook; `stack bench train-memory` turns it on."""
    profile_steps: int = 6
    """Steps `stack profile` records (after 2 warm-up steps)."""
    tracking_uri: str = ""
    """MLflow tracking store for `stack train` (and `stack eval`/`deploy`/`runs`): empty = the SQLite file
    `mlruns.db` beside train.out_dir (nothing to start); a path = that SQLite file; `http(s)://host:port` = a
    tracking server; `sqlite:///`, `postgresql://`, `mysql://` URIs as MLflow takes them; `off` = no tracking."""

    def __post_init__(self):
        # YAML 1.1 reads an unquoted `off`/`no`/`false` as a boolean, which this string field receives as 'False'
        if str(self.tracking_uri).strip().lower() in TRACKING_OFF:
            self.tracking_uri = "off"

    def problems(self) -> Problems:
        found: Problems = []
        _positive(found, "max_epochs", self.max_epochs)
        if self.max_steps == 0 or self.max_steps < -1:
            found.append(("max_steps", f"got {self.max_steps}; use -1 (no bound) or a positive count"))
        _positive(found, "lr", self.lr)
        for name in ("weight_decay", "warmup_steps", "grad_clip"):
            value = getattr(self, name)
            if value < 0:
                found.append((name, f"got {value}; must be >= 0"))
        _choice(found, "accelerator", self.accelerator, ACCELERATORS)
        _choice(found, "strategy", self.strategy, STRATEGIES)
        _choice(found, "precision", self.precision, PRECISIONS)
        _positive(found, "devices", self.devices)
        _positive(found, "num_nodes", self.num_nodes)
        _positive(found, "checkpoint_every_n_steps", self.checkpoint_every_n_steps)
        _choice(found, "launcher", self.launcher, LAUNCHERS)
        for name in ("keep_checkpoints", "log_every_n_steps", "profile_steps"):
            _positive(found, name, getattr(self, name))
        _bounded(found, self, TRAIN_BOUNDS)
        if self.peak_tflops < 0:
            found.append(("peak_tflops", f"got {self.peak_tflops}; use 0 (measure) or a positive peak"))
        scheme = self.tracking_uri.split("://", 1)[0] if "://" in self.tracking_uri else ""
        path_named = not scheme and self.tracking_uri not in ("", "off", "databricks")
        if scheme and scheme.split("+")[0] not in TRACKING_SCHEMES or self.tracking_uri.startswith("file:"):
            found.append(("tracking_uri", f"got {self.tracking_uri!r}; use empty (SQLite beside out_dir), a .db path, "
                                          f"off, or a URI of {', '.join(TRACKING_SCHEMES)} (MLflow's file store is "
                                          "retired: use a .db path)"))
        elif scheme.startswith("sqlite") and not self.tracking_uri.split("://", 1)[1].startswith("/"):
            found.append(("tracking_uri", f"got {self.tracking_uri!r}: a sqlite URI needs three slashes and a path "
                                          "(sqlite:///runs/mlruns.db; with two, SQLAlchemy keeps the store in memory "
                                          "and every run is lost), or give the path alone"))
        elif path_named and not self.tracking_uri.lower().endswith(TRACKING_FILES):
            found.append(("tracking_uri", f"got {self.tracking_uri!r}, which is neither a URI nor a SQLite file "
                                          f"({', '.join(TRACKING_FILES)}); use empty (mlruns.db beside out_dir), "
                                          "a path like runs/mlruns.db, a server URI, or off"))
        if not self.fsdp_units:
            found.append(("fsdp_units", "got an empty list; use [\"*\"] to shard each top-level part"))
        world = self.devices * self.num_nodes
        replicate = self.num_nodes if self.fsdp_replicate == "auto" else (
            int(self.fsdp_replicate) if str(self.fsdp_replicate).isdigit() else 0)
        if replicate < 1 or world % replicate:
            found.append(("fsdp_replicate", f"got {self.fsdp_replicate!r}; use auto (one replica per node) or a "
                                            f"divisor of the {world} ranks (num_nodes x devices)"))
        host, _, port = self.rendezvous.rpartition(":")
        if not host or not port.isdigit() or any(c.isspace() for c in host):
            found.append(("rendezvous", f"got {self.rendezvous!r}; expected host:port, e.g. node001:29500"))
        # these are written into the sbatch script (stack.train.launch): formats, not just strings
        for name, check in (("slurm_time", safe_values.slurm_time), ("slurm_partition", safe_values.slurm_partition)):
            message = check(getattr(self, name))
            found += [(name, message)] if message else []
        found += [(f"slurm_extra.{i}", m) for i, m in enumerate(map(safe_values.slurm_option, self.slurm_extra)) if m]
        _positive(found, "slurm_signal_seconds", self.slurm_signal_seconds)
        limit = safe_values.slurm_time_seconds(self.slurm_time) if not safe_values.slurm_time(self.slurm_time) else None
        if self.slurm_requeue and limit is not None and self.slurm_signal_seconds >= limit:
            found.append(("slurm_signal_seconds", f"got {self.slurm_signal_seconds} s with train.slurm_time="
                          f"{self.slurm_time} ({limit} s): the job would be signalled and requeued before it trains; "
                          "expected fewer seconds than the time limit (leave time to train and to write a checkpoint)"))
        if self.slurm_cpus_per_task < 0:
            found.append(("slurm_cpus_per_task", f"got {self.slurm_cpus_per_task}; expected 0 (the cluster's default) or a count of CPUs per rank"))
        for name, check in (("slurm_mem", safe_values.slurm_mem), ("slurm_container_image", safe_values.container_image)):
            message = check(getattr(self, name))
            found += [(name, message)] if message else []
        found += [(f"slurm_container_mounts.{i}", m)
                  for i, m in enumerate(map(safe_values.container_mount, self.slurm_container_mounts)) if m]
        return found


# ------------------------------------------------------------------------- export


EXPORT_BOUNDS = (
    ("batch_size", 256, "frames per engine run (a car's computer runs one frame at a time); e.g. 1"),
    ("calibration_samples", 100_000, "samples (INT8 ranges settle within hundreds); e.g. 64"),
    ("accuracy_samples", 100_000, "samples (each runs fp32 and INT8); e.g. 32"),
    ("sensitivity_samples", 10_000, "samples (each runs once per ranked layer); e.g. 4"),
    ("max_fp32_layers", 10_000, "layers (more than the network has); e.g. 8"),
    ("timing_runs", 100_000, "runs per model (a p99 settles within hundreds); e.g. 100"),
    ("timing_warmup", 10_000, "runs; e.g. 10"),
)
"""Upper bounds of ExportConfig's counts: (field, bound, why)."""


@dataclass
class ExportConfig:
    """How `stack export` writes the ONNX graph and how it is quantized."""

    out_dir: str = "runs/export"
    """Folder for ONNX files and deploy bundles."""
    opset: int = 17
    """ONNX opset; 17 is read by TensorRT 8.6 (JetPack 5) and 10.x (JetPack 6)."""
    batch_size: int = 1
    """Static batch size baked into the graph (engines run one frame at a time)."""
    calibration_samples: int = 64
    """Validation samples used to calibrate INT8 activation ranges."""
    parity_atol: float = 1e-3
    """Largest allowed |ONNX Runtime - PyTorch| per fp32 output (plus parity_rtol x the output's peak)."""
    parity_rtol: float = 1e-3
    """Relative part of the parity tolerance, times the largest |PyTorch output| of that output."""
    accuracy_samples: int = 32
    """Validation samples on which fp32 and INT8 are scored per head (the accuracy gate)."""
    keep_fp32: List[str] = field(default_factory=lambda: ["view_transform", "planning_head"])
    """Substrings of ONNX node names never quantized: the BEV pooling's gathers and matmuls, and the
    planning head (0.02% of the FLOPs; its waypoints are metres, where INT8 weights cost L2)."""
    max_fp32_layers: int = 8
    """Most layers the accuracy gate may keep in fp32 when a head exceeds its budget (0: no fallback)."""
    sensitivity_samples: int = 4
    """Validation samples used to rank layers by quantization sensitivity."""
    timing_runs: int = 100
    """Timed runs per model when latency is measured (median and p99 over them)."""
    timing_warmup: int = 10
    """Untimed runs before timing (allocations, thread pools, caches)."""

    def problems(self) -> Problems:
        found: Problems = []
        _in_range(found, "opset", self.opset, 13, 23)
        _positive(found, "batch_size", self.batch_size)
        _positive(found, "calibration_samples", self.calibration_samples)
        _positive(found, "parity_atol", self.parity_atol)
        for name in ("accuracy_samples", "sensitivity_samples", "timing_runs"):
            _positive(found, name, getattr(self, name))
        for name in ("parity_rtol", "max_fp32_layers", "timing_warmup"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; must be >= 0"))
        if self.timing_runs < 20:
            found.append(("timing_runs", f"got {self.timing_runs}; a p99 needs at least 20 runs"))
        _bounded(found, self, EXPORT_BOUNDS)
        return found


# ------------------------------------------------------------------------ targets

MAX_EPISODES = 100_000
"""Most closed-loop episodes per policy (drive.episodes, targets.*.closed_loop.episodes): days on a CPU."""
MAX_EPISODE_SECONDS = 600.0
MAX_LATENCY_MS = 10_000.0

RUNTIMES = ("tensorrt", "onnxruntime")
TARGET_PRECISIONS = ("fp32", "fp16", "int8", "best")
QDQ_FLAVOURS = ("none", "tensorrt", "onnxruntime-cpu")


@dataclass
class AccuracyBudget:
    """Largest drop allowed per head when quantizing (absolute, in the metric's units)."""

    detection_map: float = 0.02
    """Drop in detection mAP."""
    segmentation_miou: float = 0.02
    """Drop in segmentation mIoU."""
    depth_abs_rel: float = 0.01
    """Rise in depth AbsRel."""
    planning_l2_3s_m: float = 0.10
    """Rise in planning L2 at 3 s, metres."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("detection_map", "segmentation_miou", "depth_abs_rel", "planning_l2_3s_m"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; a budget must be >= 0"))
        return found


@dataclass
class ClosedLoopBudget:
    """The closed-loop gate of `stack deploy`: the INT8 model drives the same held-out episodes as the fp32
    model (`stack.deploy.gates.closed_loop`) and may not drive worse by more than this."""

    episodes: int = 0
    """Episodes both models drive (spread over `drive.scenarios` and `drive.seeds`); 0 turns the gate off."""
    driving_score_drop: float = 0.10
    """Largest drop in mean driving score (CARLA's route completion x infraction penalties, 0-1)."""
    collision_rise: float = 0.10
    """Largest rise in at-fault collisions per episode."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("episodes", "driving_score_drop", "collision_rise"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; must be >= 0"))
        _at_most(found, "episodes", self.episodes, MAX_EPISODES, "(days of driving on a CPU); e.g. 28")
        return found


@dataclass
class Target:
    """A deploy target: the computer, its runtime, and the real-time bar it must clear."""

    description: str = ""
    """Human-readable name of the hardware."""
    runtime: str = "onnxruntime"
    """`tensorrt` or `onnxruntime`."""
    precision: str = "int8"
    """Engine precision: `fp32`, `fp16`, `int8` or `best`: on TensorRT INT8 with FP16 fallback per layer; on
    ONNX Runtime the faster of INT8 and fp32 (timed side by side) among those that pass the accuracy gate."""
    qdq_flavour: str = "onnxruntime-cpu"
    """INT8 QDQ form: `tensorrt` (symmetric S8/S8, per-channel weights, zero points 0),
    `onnxruntime-cpu` (U8 activations / S8 weights), or `none`."""
    int8_tops: float = 0.0
    """Dense INT8 peak, tera-ops/s (0 when the target has no INT8 path)."""
    fp16_tflops: float = 0.0
    """Dense FP16 peak, TFLOP/s."""
    fp32_tflops: float = 0.0
    """Dense FP32 peak, TFLOP/s."""
    memory_bandwidth_gbs: float = 0.0
    """DRAM bandwidth, GB/s."""
    peaks_source: str = ""
    """Where the peaks come from (datasheet, measurement)."""
    camera_hz: float = 12.0
    """Frame rate of the cameras the network consumes (one inference per frame); the frame period is
    1000 / camera_hz ms (nuScenes' surround cameras: 12 Hz, 83.3 ms)."""
    network_share: float = 0.5
    """Share of the frame period left to this network (0-1]; the rest of the period belongs to
    image decoding, pre/post-processing, tracking, prediction and control on the same computer.
    The latency budget is network_share x the frame period."""
    min_fps: float = 0.0
    """Real-time bar on the median latency, frames/s; 0 derives it from the budget: 1000 / budget ms
    (the median network run fits its share of the frame period)."""
    max_p99_latency_ms: float = 0.0
    """Real-time bar on the 99th-percentile latency, ms; 0 derives it: the frame period minus the other
    stages' time (`other_stages_ms`): a run longer than that makes the frame miss its period."""
    other_stages_ms: float = 0.0
    """Time per frame of the pipeline's other stages in series with the network on the same computer
    (decoding, pre/post-processing, tracking, prediction, control), ms; 0 derives it: the rest of the period,
    (1 - network_share) x the frame period. The p99 bar is the period minus this, so with the derived value
    the network's tail must fit its own share and the p99 bar can fail at any network_share."""
    timing_inconclusive_passes: bool = False
    """When a measured FPS verdict is inconclusive (the spread of its repeats straddles the bar), pass
    instead of fail. Off: an inconclusive verdict fails the gate for the shipping precision."""
    measured: bool = False
    """True when the gate times the engine on this machine; false when it is predicted."""
    dla_core: int = -1
    """DLA core for TensorRT (-1: GPU only)."""
    device_compute_capability: str = ""
    """CUDA compute capability of the target's GPU (`8.7` for every Jetson Orin): a TensorRT timing counts as
    this target's measurement only on a GPU with this capability; elsewhere it is information and the gate
    uses the prediction. Empty: no TensorRT timing ever counts as measured on this target."""
    device_multiprocessors: int = 0
    """Streaming multiprocessors of the target's GPU (AGX Orin 16, Orin NX / Orin Nano 8), checked with the
    compute capability when > 0: it tells Orin modules apart."""
    device_name_pattern: str = ""
    """Regular expression searched in the device's identity ("CUDA name | board model", the board model from
    /proc/device-tree/model on a Jetson); checked when not empty."""
    reference_workload_ms: float = 0.0
    """Time per run of the reference workload (a 512x512 fp32 MatMul in ONNX Runtime) on the machine the
    bar was set for. When > 0, measured latency is scaled by this / the reference timed in the same run
    (mean per run over blocks between the model's timing rounds, `stack.deploy.gates.fps.time_side_by_side`),
    so a busier or slower machine does not flip the gate; 0 compares raw latency."""
    accuracy_budget: AccuracyBudget = field(default_factory=AccuracyBudget)
    """Largest accuracy drop allowed per head."""
    closed_loop: ClosedLoopBudget = field(default_factory=ClosedLoopBudget)
    """How much worse the INT8 model may drive than fp32 in closed loop (off when episodes is 0)."""

    def __post_init__(self):
        """Derive the bars left at 0 from the camera rate and the network's share of the frame period."""
        if self.camera_hz > 0 and 0 < self.network_share <= 1:
            self.min_fps = self.min_fps or round(1000.0 / self.latency_budget_ms(), 3)
            self.other_stages_ms = self.other_stages_ms or round((1 - self.network_share) * self.frame_period_ms(), 3)
            self.max_p99_latency_ms = self.max_p99_latency_ms or round(self.frame_period_ms() - self.other_stages_ms, 3)

    def frame_period_ms(self) -> float:
        return 1000.0 / self.camera_hz

    def latency_budget_ms(self) -> float:
        """The network's share of one frame period, ms."""
        return self.network_share * self.frame_period_ms()

    def problems(self) -> Problems:
        found: Problems = []
        _choice(found, "runtime", self.runtime, RUNTIMES)
        _choice(found, "precision", self.precision, TARGET_PRECISIONS)
        _choice(found, "qdq_flavour", self.qdq_flavour, QDQ_FLAVOURS)
        for name in ("int8_tops", "fp16_tflops", "fp32_tflops", "memory_bandwidth_gbs"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; a peak must be >= 0"))
        _positive(found, "camera_hz", self.camera_hz)
        if not 0 < self.network_share <= 1:
            found.append(("network_share", f"got {self.network_share}; a share of the frame period must be in (0, 1]"))
        _positive(found, "min_fps", self.min_fps)
        _positive(found, "max_p99_latency_ms", self.max_p99_latency_ms)
        if self.camera_hz > 0 and not 0 <= self.other_stages_ms < self.frame_period_ms():
            found.append(("other_stages_ms", f"got {self.other_stages_ms}; the other stages must leave the network "
                                             f"part of the {self.frame_period_ms():.1f} ms frame period (0 derives it)"))
        if self.reference_workload_ms < 0:
            found.append(("reference_workload_ms", f"got {self.reference_workload_ms}; must be >= 0 (0 disables)"))
        if self.dla_core < -1:
            found.append(("dla_core", f"got {self.dla_core}; use -1 (GPU only) or a DLA core index"))
        _bounded(found, self, (
            ("dla_core", 15, "(Jetson Orin has DLA cores 0 and 1); e.g. 0, or -1 for the GPU alone"),
            ("device_multiprocessors", 4096, "SMs (the largest GPUs have ~150); e.g. 16"),
            ("camera_hz", 1_000.0, "Hz (automotive cameras run at 10-60 Hz); e.g. 12")))
        if self.precision in ("int8", "best") and self.qdq_flavour == "none":
            found.append(("qdq_flavour", f"precision {self.precision} needs a QDQ flavour, got 'none'"))
        if self.device_compute_capability and not re.fullmatch(r"\d+\.\d+", self.device_compute_capability):
            found.append(("device_compute_capability",
                          f"got {self.device_compute_capability!r}; expected MAJOR.MINOR such as '8.7', or empty"))
        if self.device_multiprocessors < 0:
            found.append(("device_multiprocessors", f"got {self.device_multiprocessors}; must be >= 0 (0: not checked)"))
        try:
            re.compile(self.device_name_pattern)
        except re.error as exc:
            found.append(("device_name_pattern", f"got {self.device_name_pattern!r}, not a regular expression ({exc})"))
        return found


# -------------------------------------------------------------------------- drive

DRIVE_SCENARIOS = ("route", "lead_brake", "stopped_vehicle", "zebra_crossing", "jaywalker", "unprotected_turn", "cut_in")
"""Scenario families of the closed loop (`stack.sim.scenarios` builds them)."""
DRIVE_BASELINES = ("expert", "constant_velocity", "ego_rollout")
"""Policies that need no network: the privileged expert (upper bound) and two blind ones."""



@dataclass
class DaggerConfig:
    """`stack dagger`: the student drives training episodes, the expert labels the states it visits, the
    student is fine-tuned on everything recorded so far (DAgger, Ross, Gordon & Bagnell, AISTATS 2011)."""

    out_dir: str = "runs/dagger"
    """Folder for each iteration's recorded dataset and fine-tuned weights, the summary and its plot."""
    iterations: int = 3
    """Rounds of drive -> label -> aggregate -> fine-tune."""
    episodes: int = 28
    """Training episodes the student drives per iteration (new worlds each iteration; never evaluation ones)."""
    beta: float = 0.5
    """Share of replanning instants the expert drives in the first iteration (Ross et al.'s beta_1)."""
    beta_decay: float = 0.5
    """beta_i = beta * beta_decay^(i-1): the student takes over as it improves."""
    steps: int = 150
    """Fine-tuning steps per iteration, on data.root's train split plus every recorded iteration."""
    overwrite: bool = False
    """Start over in an out_dir that holds an earlier DAgger run (else it is refused)."""

    def problems(self) -> Problems:
        found: Problems = []
        _in_range(found, "iterations", self.iterations, 1, 100)
        _in_range(found, "episodes", self.episodes, 1, 100_000)
        _in_range(found, "beta", self.beta, 0.0, 1.0)
        _in_range(found, "beta_decay", self.beta_decay, 0.0, 1.0)
        _in_range(found, "steps", self.steps, 1, 10_000_000)
        return found


@dataclass
class DriveConfig:
    """Closed-loop evaluation (`stack drive`): a policy drives the ego in the rendered world."""

    out_dir: str = "runs/drive"
    """Folder for drive.md / drive.json / drive.png and the clips."""
    scenarios: List[str] = field(default_factory=lambda: list(DRIVE_SCENARIOS))
    """Scenario families to drive, from DRIVE_SCENARIOS."""
    episodes: int = 56
    """Episodes per policy, spread round-robin over the families and then the seeds."""
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])
    """Evaluation seeds: each gives other instances of every family (held out: training scenes never use
    them); results are mean +/- std over seeds."""
    episode_seconds: float = 8.0
    """Simulated length of an episode."""
    sim_hz: float = 10.0
    """Simulation rate: the ego's vehicle model, the controller and the other road users step at it."""
    replan_hz: float = 2.0
    """Camera and replanning rate; sim_hz / replan_hz must be a whole number."""
    latency_ms: float = -1.0
    """Delay before a network's plan reaches the controller; -1: measured on this host for ONNX Runtime
    bundles and checkpoints, the latency model's prediction for TensorRT targets."""
    baselines: List[str] = field(default_factory=lambda: list(DRIVE_BASELINES))
    """Baseline policies driven beside the network, from DRIVE_BASELINES."""
    workers: int = 2
    """Worker processes that run episodes in parallel (one torch / ONNX Runtime thread each)."""
    clips: int = 2
    """MP4 clips written per policy, of its worst episodes (lowest driving score)."""
    blocked_seconds: float = 3.0
    """An episode ends as blocked when the ego stands (under 0.5 m/s) for this long while at every step the
    privileged expert would drive on (CARLA's agent-blocked rule, scaled to our seconds-long episodes; stack.sim.infractions)."""
    route_deviation_m: float = 10.0
    """An episode ends when the ego's centre is farther than this from its route's centreline (CARLA's
    route-deviation rule; our roads are 12 m wide)."""

    def problems(self) -> Problems:
        found: Problems = []
        unknown = [s for s in self.scenarios if s not in DRIVE_SCENARIOS]
        if unknown or not self.scenarios:
            found.append(("scenarios", f"got {list(self.scenarios)!r}; choose from {', '.join(DRIVE_SCENARIOS)}"))
        unknown = [b for b in self.baselines if b not in DRIVE_BASELINES]
        if unknown:
            found.append(("baselines", f"got {list(self.baselines)!r}; choose from {', '.join(DRIVE_BASELINES)}"))
        if not self.seeds:
            found.append(("seeds", "got an empty list; give at least one evaluation seed"))
        for name in ("episodes", "episode_seconds", "sim_hz", "replan_hz", "blocked_seconds", "route_deviation_m"):
            _positive(found, name, getattr(self, name))
        if self.sim_hz > 0 and self.replan_hz > 0:
            ratio = self.sim_hz / self.replan_hz
            if abs(ratio - round(ratio)) > 1e-6 or round(ratio) < 1:
                found.append(("replan_hz", f"got {self.replan_hz} with sim_hz {self.sim_hz}; sim_hz / replan_hz must "
                                           f"be a whole number >= 1 (e.g. 2, 5 or 10 Hz at 10 Hz)"))
        if self.replan_hz > 0 and 0 < self.episode_seconds < 2.0 / self.replan_hz:
            found.append(("episode_seconds", f"got {self.episode_seconds} with replan_hz {self.replan_hz}: an episode "
                                             f"must last at least two replanning periods ({2.0 / self.replan_hz:g} s) "
                                             f"for a plan to be driven and scored; e.g. 8 s"))
        if self.latency_ms < 0 and self.latency_ms != -1:
            found.append(("latency_ms", f"got {self.latency_ms}; use -1 (measure / predict) or a delay >= 0 ms"))
        elif self.latency_ms > MAX_LATENCY_MS:
            found.append(("latency_ms", f"got {self.latency_ms}; a plan that arrives after {MAX_LATENCY_MS:g} ms is never "
                                        f"driven in an episode of seconds: use at most {MAX_LATENCY_MS:g}"))
        _bounded(found, self, (
            ("episodes", MAX_EPISODES, "(days of driving on a CPU); e.g. 56"),
            ("episode_seconds", MAX_EPISODE_SECONDS, "s (the scenarios stage their event in the first seconds); e.g. 8"),
            ("sim_hz", 1_000.0, "Hz (the vehicle model is stable at 10 Hz); e.g. 10"),
            ("seeds", 1_000, "seeds (each multiplies the episodes' worlds); e.g. [0, 1, 2]"),
            ("clips", 1_000, "clips per policy (each is an MP4 of an episode); e.g. 2")))
        _in_range(found, "workers", self.workers, 0, 64)
        if self.clips < 0:
            found.append(("clips", f"got {self.clips}; must be >= 0"))
        return found


# ----------------------------------------------------------------------- pipeline


def temporal_problems(pipeline: "Pipeline") -> Problems:
    """What a network fusing the previous key frame (model.temporal_frames) needs from the data and the loop."""
    if not pipeline.model.temporal_frames:
        return []
    found: Problems = []
    data, why = pipeline.data, "model.temporal_frames=1 fuses the key frame 0.5 s earlier"
    if data.backend != "torch":
        found.append(("data.backend", f"got {data.backend}; {why}, which the torch loader reads: set data.backend=torch"))
    if data.layout != "frames":
        found.append(("data.layout", f"got {data.layout}; {why}, read from frame shards: set data.layout=frames"))
    if data.world.frame_rate_hz != 2.0:
        found.append(("data.world.frame_rate_hz", f"got {data.world.frame_rate_hz}; {why}: key frames at 2 Hz"))
    if pipeline.drive.replan_hz != 2.0:
        found.append(("drive.replan_hz", f"got {pipeline.drive.replan_hz}; {why}: replan at 2 Hz in closed loop"))
    return found


@dataclass
class Pipeline:
    """The whole run: data → model → train → export → deploy targets."""

    name: str = "stack"
    """Name of this pipeline; artifacts and reports carry it."""
    schema_version: int = SCHEMA_VERSION
    """Version of this schema the config was written for."""
    data: DataConfig = field(default_factory=DataConfig)
    """Sensor data: world generator, rig, shards, loaders."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The multi-task network."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """ONNX export and quantization."""
    drive: DriveConfig = field(default_factory=DriveConfig)
    """Closed-loop evaluation."""
    dagger: DaggerConfig = field(default_factory=DaggerConfig)
    """Closed-loop fine-tuning on the states the student visits, labelled by the expert."""
    targets: Dict[str, Target] = field(default_factory=dict)
    """Deploy targets by name; `configs/targets/*.yaml` are loaded here under their file names."""

    def problems(self) -> Problems:
        found: Problems = []
        if self.schema_version != SCHEMA_VERSION:
            found.append(("schema_version",
                          f"got {self.schema_version}; this stack reads schema {SCHEMA_VERSION}"))
        found += temporal_problems(self)
        for name in self.targets:  # each names a bundle folder under export.out_dir
            message = safe_values.identifier(name)
            found += [(f"targets.{name}", message)] if message else []
        return found
