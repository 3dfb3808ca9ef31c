"""`data`: the rig, the rendered world, augmentation, shards and loaders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from stack.pipeline.checks import Problems, bounded, choice, in_range, increasing, positive


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
        in_range(found, "hfov_deg", self.hfov_deg, 10.0, 170.0)
        in_range(found, "pitch_deg", self.pitch_deg, -60.0, 60.0)
        positive(found, "z", self.z)
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

MOUNT_JITTER_MAX_M, MOUNT_JITTER_MAX_DEG = 0.4, 4.0
"""Largest per-scene mount variation data.world allows: under the tolerances within which a dataset's cameras still
count as data.rig (stack.data.camera_records.RIG_ATOL_M 0.5 m, RIG_ATOL_DEG 5 degrees)."""


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
        bounded(found, self, (
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
    mount_jitter_m: float = 0.0
    """Each scene's vehicle carries each camera up to this much higher or lower than data.rig says (uniform, one
    draw per camera per scene, as vehicles of one model differ): the stored calibration is the one rendered, so
    the labels stay exact. 0: every scene on the nominal rig. The closed-loop episodes keep the nominal rig."""
    mount_jitter_deg: float = 0.0
    """Likewise each camera's pitch, degrees. With mount_jitter_m, the variation a camera-aware depth head
    (model.depth.camera_aware) must read from the calibration: without it only the resize augmentation's focal
    length varies in training (docs/log/2026-11-28_camera-aware-depth.md)."""
    expert_sees: str = "everyone"
    """Whom the expert that drives and labels those episodes (and labels DAgger's states) reacts to: `everyone`
    (privileged: every road user, hidden or not) or `cameras` (only road users that have had a visible pixel in
    some camera in the episode so far, the rule the detector's labels follow): a teacher that brakes for a pedestrian no
    camera shows asks the student for what it cannot learn (LEAD, Nguyen et al. 2025). The baseline
    `expert` policy of `stack drive` stays privileged."""

    def problems(self) -> Problems:
        found: Problems = []
        in_range(found, "drive_episodes", self.drive_episodes, 0, 100_000)
        in_range(found, "mount_jitter_m", self.mount_jitter_m, 0.0, MOUNT_JITTER_MAX_M)
        in_range(found, "mount_jitter_deg", self.mount_jitter_deg, 0.0, MOUNT_JITTER_MAX_DEG)
        choice(found, "expert_sees", self.expert_sees, ("everyone", "cameras"))
        bounded(found, self, (
            ("scenes", 100_000, "scenes (a million rendered frames and more); e.g. 40"),
            ("frames_per_scene", 10_000, "frames per scene (over an hour at 2 Hz; scenes last seconds); e.g. 40"),
            ("frame_rate_hz", 100.0, "Hz (cameras run at 10-30 Hz; nuScenes annotates at 2 Hz); e.g. 2"),
            ("agents_per_scene", 1_000, "road users per scene (a junction holds tens); e.g. 24"),
            ("spawn_radius_m", 1_000.0, "m (the BEV grid sees 50 m around the ego); e.g. 70")))
        for name in ("scenes", "frames_per_scene", "frame_rate_hz", "spawn_radius_m"):
            positive(found, name, getattr(self, name))
        unknown = sorted(set(self.class_mix) - set(AGENT_CLASS_MIX))
        if unknown or not self.class_mix or min(self.class_mix.values()) < 0 or sum(self.class_mix.values()) <= 0:
            found.append(("class_mix", f"got {dict(self.class_mix)}; expected non-negative weights, not all zero, "
                          f"for classes among {list(AGENT_CLASS_MIX)}"))
        if self.agents_per_scene < 0:
            found.append(("agents_per_scene", f"got {self.agents_per_scene}; must be >= 0"))
        in_range(found, "val_fraction", self.val_fraction, 0.0, 0.9)
        in_range(found, "workers", self.workers, 0, 64)
        choice(found, "render_device", self.render_device, ("auto", "cpu", "cuda"))
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
        increasing(found, "resize_scale", self.resize_scale, 2)
        if self.resize_scale and min(self.resize_scale) <= 0:
            found.append(("resize_scale", f"got {list(self.resize_scale)!r}; scales must be > 0"))
        in_range(found, "bev_rotate_deg", self.bev_rotate_deg, 0.0, 180.0)
        in_range(found, "color_jitter", self.color_jitter, 0.0, 1.0)
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
        choice(found, "layout", self.layout, SHARD_LAYOUTS)
        choice(found, "backend", self.backend, DATA_BACKENDS)
        positive(found, "batch_size", self.batch_size)
        bounded(found, self, (
            ("batch_size", MAX_BATCH_SIZE, "samples per rank (more images than any GPU holds); e.g. 4 on a CPU, "
                                           "8-64 on a GPU"),
            ("samples_per_shard", 100_000, "samples per shard (a shard is one worker's unit of reading; "
                                           "WebDataset shards hold hundreds); e.g. 64")))
        positive(found, "samples_per_shard", self.samples_per_shard)
        in_range(found, "num_workers", self.num_workers, 0, 64)
        in_range(found, "jpeg_quality", self.jpeg_quality, 1, 100)
        if self.layout == "clips" and self.world.drive_episodes > 0:
            found.append(("world.drive_episodes", f"got {self.world.drive_episodes} with layout clips: closed-loop "
                                                  f"training frames are written as frames shards; set data.layout=frames "
                                                  f"or data.world.drive_episodes=0"))
        return found
