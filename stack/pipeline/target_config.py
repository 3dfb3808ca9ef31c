"""`targets`: what each deploy target (a car's computer, a CI runner) must meet: runtime, precision, QDQ flavour,
accuracy and closed-loop budgets, FPS."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from stack.pipeline.checks import Problems, at_most, bounded, choice, positive


CONFIG_DIR = Path(os.environ.get("STACK_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))
"""The repository's `configs/` folder (override with STACK_CONFIG_DIR)."""
TARGETS_DIR = CONFIG_DIR / "targets"
"""One YAML file per deploy target; a target's relative `reference_graph` is found here too."""

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
    driving_score_drop: float = 0.08
    """Largest drop in mean driving score (CARLA's route completion x infraction penalties, 0-1); the default is
    derived: the RMS difference between two training seeds (`stack.deploy.gates.closed_loop_budget`)."""
    collision_rise: float = 0.11
    """Largest rise in at-fault collisions per episode (derived by the same rule)."""
    inconclusive_passes: bool = False
    """When a mean is within its budget but its 90% paired interval over episodes reaches past it, pass instead
    of fail. Off: an inconclusive closed-loop comparison fails INT8 (fp32 then ships where the target may)."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("episodes", "driving_score_drop", "collision_rise"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; must be >= 0"))
        at_most(found, "episodes", self.episodes, MAX_EPISODES, "(days of driving on a CPU); e.g. 77")
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
    accuracy_inconclusive_passes: bool = False
    """When a head's INT8 drop passes on its point estimate but its bootstrap interval (resampling whole validation
    scenes) straddles the budget, pass instead of fail. Off: an inconclusive verdict fails the shipping precision (an
    ONNX Runtime `best` target then ships fp32); the report says how many scenes would tell a drop of the budget's
    size from none (a power calculation)."""
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
    """Time per run of the reference workload (`reference_graph` in ONNX Runtime) on the machine the bar was
    set for. When > 0, measured latency is scaled by this / the reference timed in the same run (one reference
    run after every model run, `stack.deploy.gates.fps.time_side_by_side`), so a busier, slower or differently
    built CPU does not flip the gate; 0 compares raw latency."""
    reference_graph: str = ""
    """The reference workload: a frozen network graph (`stack.deploy.reference_graph`, written by `stack bench
    fps-bar`), relative to configs/targets/ or absolute. Needed when reference_workload_ms > 0."""
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

    def reference_graph_path(self) -> Path:
        path = Path(self.reference_graph)
        return path if path.is_absolute() or not self.reference_graph else TARGETS_DIR / path

    def frame_period_ms(self) -> float:
        return 1000.0 / self.camera_hz

    def latency_budget_ms(self) -> float:
        """The network's share of one frame period, ms."""
        return self.network_share * self.frame_period_ms()

    def problems(self) -> Problems:
        found: Problems = []
        choice(found, "runtime", self.runtime, RUNTIMES)
        choice(found, "precision", self.precision, TARGET_PRECISIONS)
        choice(found, "qdq_flavour", self.qdq_flavour, QDQ_FLAVOURS)
        for name in ("int8_tops", "fp16_tflops", "fp32_tflops", "memory_bandwidth_gbs"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; a peak must be >= 0"))
        positive(found, "camera_hz", self.camera_hz)
        if not 0 < self.network_share <= 1:
            found.append(("network_share", f"got {self.network_share}; a share of the frame period must be in (0, 1]"))
        positive(found, "min_fps", self.min_fps)
        positive(found, "max_p99_latency_ms", self.max_p99_latency_ms)
        if self.camera_hz > 0 and not 0 <= self.other_stages_ms < self.frame_period_ms():
            found.append(("other_stages_ms", f"got {self.other_stages_ms}; the other stages must leave the network "
                                             f"part of the {self.frame_period_ms():.1f} ms frame period (0 derives it)"))
        if self.reference_workload_ms < 0:
            found.append(("reference_workload_ms", f"got {self.reference_workload_ms}; must be >= 0 (0 disables)"))
        if self.reference_workload_ms > 0 and not self.reference_graph_path().is_file():
            found.append(("reference_graph", f"got {self.reference_graph!r}, no file at {self.reference_graph_path()}; "
                                             f"a target normalised by a reference workload needs its frozen graph "
                                             f"(`stack bench fps-bar` writes one), or set reference_workload_ms=0"))
        if self.dla_core < -1:
            found.append(("dla_core", f"got {self.dla_core}; use -1 (GPU only) or a DLA core index"))
        bounded(found, self, (
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
