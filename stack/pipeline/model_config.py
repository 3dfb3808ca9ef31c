"""`model`: the multi-task network (backbone, BEV grid, depth bins, heads, planner, losses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from stack.pipeline.checks import Problems, bounded, choice, in_range, increasing, positive


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
            increasing(found, name, getattr(self, name), 2)
        positive(found, "cell_size", self.cell_size)
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
    camera_aware: bool = False
    """The depth head also reads its camera's intrinsics, height and tilt through an MLP that gates its depth and
    context features (BEVDepth's camera-aware DepthNet, `stack.models.image_heads`): one network for cameras whose
    calibration differs from vehicle to vehicle. Export bakes the rig's camera into the graph with its pooling."""

    def problems(self) -> Problems:
        found: Problems = []
        positive(found, "min_m", self.min_m)
        if self.max_m <= self.min_m:
            found.append(("max_m", f"got {self.max_m}; must be greater than min_m ({self.min_m})"))
        in_range(found, "bins", self.bins, 2, 512)
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
    velocity: float = 0.2
    """L1 weight of each of the two velocity fields inside the box regression, beside 1.0 for every other field
    (CenterPoint's code_weights). A temporal network (temporal_frames > 0) has motion to read; a heavier weight
    trades box fit for velocity, which the plan guard moves detections at."""
    attributes: float = 0.2
    """Weight of the attribute cross entropy (model.attribute_head) inside the detection loss, beside the heatmap's
    focal loss and the box L1 (which it must not outweigh: ln 8 = 2.1 at the start against a focal loss of ~1)."""
    depth_road_users: float = 0.0
    """Extra weight of road users' pixels (the segmentation classes that are detection classes) in the depth
    cross entropy: a pixel of a car weighs 1 + this. They are a few per cent of the image, so an unweighted loss
    is decided by road and buildings, and a lift-splat BEV smears a road user along its camera ray by its depth
    error: the detector's position and the motion a temporal network can see are bounded by it. 2.0 at the preset's
    length (tiny-drive, 4104 steps, one seed): mAP 0.404 against 0.381, depth AbsRel 0.109 against 0.129, and it
    drove level with the preset (held-out DS 0.752, its seed 0's own); 4.0 at 2052 steps drove worse (DS 0.525).
    Not shown to move the closed loop, so no preset sets it (docs/log/2026-11-28_motion-probe-and-depth-levers.md)."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("detection", "depth", "segmentation", "planning", "velocity", "attributes", "depth_road_users"):
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
MAX_TEMPORAL_FRAMES = 4
"""Key frames a temporal network may fuse (2 s of history at 2 Hz): each adds an image encoder pass per training
sample and C channels to the memory the deployed graph carries."""
MODEL_BOUNDS = (
    ("neck_channels", 4096, "channels (ResNet-50's widest stage has 2048); e.g. 64"),
    ("bev_channels", 4096, "channels (BEV encoders use 64-512); e.g. 64"),
    ("planning_width", 4096, "channels (0: bev_channels); e.g. 0"),
    ("max_boxes", 10_000, "boxes per sample (a junction holds tens of road users); e.g. 64"),
    ("planning_modes", 256, "candidate trajectories (planners propose 6-256); e.g. 6"),
    ("planning_steps", 100, "waypoints (50 s at 0.5 s steps; planners look 3-8 s ahead); e.g. 6"),
    ("planning_layers", 64, "attention layers; e.g. 2"),
    ("planning_accelerations", 256, "accelerations (the path-speed planner scores each one); e.g. 15"),
    ("planning_objects", 512, "object tokens (a junction holds tens of road users); e.g. 32"),
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
    planning_velocity: bool = False
    """The path-speed planner's scorer also reads the detection head's velocity of whatever lies on each candidate's
    path, resolved along and across it (`stack.models.path_speed_head`). Needs temporal_frames >= 1: one frame holds
    no motion, so its velocity regression is a guess."""
    planning_objects: int = 0
    """Detections the path-speed planner attends as object tokens (`stack.models.object_planner`): the top peaks of
    the detection heatmap, decoded in the graph, each read by every speed candidate through where it will stand
    along and across the candidate's path; 0: none (the scorer reads the sampled BEV only)."""
    temporal_frames: int = 0
    """Previous key frames fused into the BEV (BEVDet4D, Huang & Huang 2022): 0, one frame (today's network), or
    k = 1 ... 4: the k key frames 0.5, 1.0 ... s earlier are lifted by the same network (no gradient, as BEVDet4D
    trains it), warped into the current ego frame by the ego motion and concatenated before the BEV encoder, so the
    heads see how things moved. Both loaders read them from the shards (`stack.data.sequences`); the closed
    loop and the exported graph carry them as one memory of k BEVs, warped once per key frame."""
    temporal_pre_blocks: int = 0
    """Residual blocks run on each frame's BEV before the temporal fusion, so that the memory carried to the next key
    frame is this small encoder's output rather than the view transform's sparse splat (BEVDet4D's `pre_process`
    net, two blocks in its configs: the paper finds fusing after a BEV encoder better). 0: the splat is fused as
    is. Only with temporal_frames >= 1."""
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
    attribute_head: bool = False
    """A CenterPoint branch of attribute logits (nuScenes' vehicle moving / stopped / parked, pedestrian moving /
    standing, cycle with / without rider), trained by cross entropy at each labelled box's centre cell and read at
    each detection's (its class's attributes only): what the devkit's mAAE, a tenth of NDS, scores. Without it
    every match's attribute error is 1. An output of the exported graph when on (`attribute_logits`)."""
    circle_nms_radius_m: Dict[str, float] = field(default_factory=dict)
    """Empty: IoU NMS (nms_iou). Otherwise CenterPoint's circle NMS instead, a radius in metres for every detection
    class: a box suppresses the lower-scoring boxes of its class whose BEV centres lie within it
    (`stack.models.decoders.circle_nms`). CenterPoint's nuScenes radii: car 2, truck 3.46, pedestrian 0.42, bicycle
    0.92 (its `min_radius` values are these squared)."""

    def road_user_classes(self) -> list[int]:
        """Indices of the segmentation classes that are also detection classes (cars, pedestrians, ...): the
        pixels the depth loss can weigh more and `stack eval` scores depth on separately."""
        return [index for index, name in enumerate(self.segmentation_classes) if name in self.detection_classes]

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("neck_channels", "bev_channels", "max_boxes", "planning_modes", "planning_steps",
                     "planning_layers"):
            positive(found, name, getattr(self, name))
        bounded(found, self, MODEL_BOUNDS)
        if self.planning_accelerations:
            positive(found, "path_points", self.path_points)
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
        in_range(found, "temporal_frames", self.temporal_frames, 0, MAX_TEMPORAL_FRAMES)
        in_range(found, "temporal_pre_blocks", self.temporal_pre_blocks, 0, 8)
        if self.temporal_pre_blocks and not self.temporal_frames:
            found.append(("temporal_pre_blocks", f"got {self.temporal_pre_blocks} with temporal_frames 0; the blocks "
                                                 f"encode each frame before the temporal fusion: set temporal_frames: "
                                                 f"1, or temporal_pre_blocks: 0"))
        if self.planning_velocity and not (self.planning_accelerations and self.temporal_frames):
            found.append(("planning_velocity", "got true; the path-speed planner reads velocities that a temporal "
                                               "network regresses: set planning_accelerations and temporal_frames: 1, "
                                               "or planning_velocity: false"))
        if self.planning_objects < 0 or (self.planning_objects and not self.planning_accelerations):
            found.append(("planning_objects", f"got {self.planning_objects}; object tokens feed the path-speed "
                                              f"planner's candidates: set planning_accelerations, or planning_objects: "
                                              f"0"))
        if self.planning_width < 0 or self.planning_width % 4:
            found.append(("planning_width", f"got {self.planning_width}; use 0 (bev_channels) or a positive multiple "
                                            f"of 4 (the planner's attention heads)"))
        choice(found, "feature_stride", self.feature_stride, (4, 8, 16, 32))
        choice(found, "segmentation_stride", self.segmentation_stride, (4, 8, 16, 32))
        if self.segmentation_stride > self.feature_stride:
            found.append(("segmentation_stride", f"got {self.segmentation_stride}; must be <= feature_stride "
                                                 f"({self.feature_stride})"))
        if self.bev_channels % 4:
            found.append(("bev_channels", f"got {self.bev_channels}; must be a multiple of 4 (planning attention heads)"))
        in_range(found, "score_threshold", self.score_threshold, 0.0, 1.0)
        in_range(found, "nms_iou", self.nms_iou, 0.0, 1.0)
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
