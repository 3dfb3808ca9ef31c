"""The one pipeline definition: a typed tree that every stage receives.

`Pipeline` is the schema. `stack.config.load_pipeline` merges YAML files and
`key=value` overrides onto it and returns a validated instance; only that object
moves between stages (data → model → train → export → deploy), and every artifact
carries its resolved YAML (`to_yaml`) so it can be rebuilt and audited.

Every key is declared in this package, one module per top-level section: `data_config`, `model_config`,
`guard_config` (the plan's post-processing), `train_config`, `export_config`, `target_config` (a deploy target's
budgets) and `drive_config` (`drive` and `dagger`); `migrations` reads artifacts of older schemas; `checks` holds the range and choice checks they share. This module assembles the sections into `Pipeline` and is the import
name of the whole schema (`from stack.pipeline import ModelConfig`).

Every field has an attribute docstring: `stack config --describe KEY` prints them,
and error messages quote them. Range and choice checks live in each section's
`problems()` method, which returns (field, message) pairs instead of raising, so a
bad config reports all of its mistakes at once, each under its full dotted key.

This package imports no stage and nothing heavier than the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from stack import safe_values
from stack.pipeline.checks import Problems
from stack.pipeline.data_config import (
    AGENT_CLASS_MIX, DATA_BACKENDS, MAX_BATCH_SIZE, MAX_CAMERAS, MAX_IMAGE_SIDE, SHARD_LAYOUTS, AugmentConfig,
    Camera, DataConfig, RigConfig, WorldConfig)
from stack.pipeline.model_config import (
    CIRCLE_NMS_MAX_M, DETECTION_CLASSES, MAX_BEV_CELLS, MODEL_BOUNDS, SEGMENTATION_CLASSES, BevGridConfig,
    DepthBinsConfig, LossWeights, ModelConfig)
from stack.pipeline.train_config import (
    ACCELERATORS, LAUNCHERS, MAX_STEPS, PRECISIONS, STRATEGIES, TRACKING_FILES, TRACKING_OFF, TRACKING_SCHEMES,
    TRAIN_BOUNDS, TrainConfig)
from stack.pipeline.export_config import EXPORT_BOUNDS, ExportConfig
from stack.pipeline.target_config import (
    MAX_EPISODES, MAX_EPISODE_SECONDS, MAX_LATENCY_MS, QDQ_FLAVOURS, RUNTIMES, TARGET_PRECISIONS, AccuracyBudget,
    ClosedLoopBudget, Target)
from stack.pipeline.drive_config import DRIVE_BASELINES, DRIVE_SCENARIOS, DaggerConfig, DriveConfig
from stack.pipeline.guard_config import GUARD_EMERGENCY_DECELERATION, GUARD_KEYS, GUARD_STANDOFF_M, GuardConfig
from stack.pipeline.migrations import (
    READABLE_SCHEMAS, REMOVED_KEYS, RENAMED_KEYS, SCHEMA_VERSION, key_history, migrate, migrate_guard_settings)


def temporal_problems(pipeline: "Pipeline") -> Problems:
    """What a network fusing the previous key frame (model.temporal_frames) needs from the data and the loop."""
    if not pipeline.model.temporal_frames:
        return []
    found: Problems = []
    k = pipeline.model.temporal_frames
    frames = "the key frame 0.5 s earlier" if k == 1 else f"the {k} key frames before it, 0.5 s apart"
    data, why = pipeline.data, f"model.temporal_frames={k} fuses {frames}"
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
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The plan's post-processing between the network and the car: the plan guard."""
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


__all__ = [
    "ACCELERATORS", "AGENT_CLASS_MIX", "AccuracyBudget", "AugmentConfig", "BevGridConfig", "CIRCLE_NMS_MAX_M",
    "Camera", "ClosedLoopBudget", "DATA_BACKENDS", "DETECTION_CLASSES", "DRIVE_BASELINES", "DRIVE_SCENARIOS",
    "DaggerConfig", "DataConfig", "DepthBinsConfig", "DriveConfig", "EXPORT_BOUNDS", "ExportConfig",
    "GUARD_EMERGENCY_DECELERATION", "GUARD_KEYS", "GUARD_STANDOFF_M", "GuardConfig", "LAUNCHERS",
    "LossWeights", "MAX_BATCH_SIZE", "MAX_BEV_CELLS", "MAX_CAMERAS", "MAX_EPISODES", "MAX_EPISODE_SECONDS",
    "MAX_IMAGE_SIDE", "MAX_LATENCY_MS", "MAX_STEPS", "MODEL_BOUNDS", "ModelConfig", "PRECISIONS", "Pipeline",
    "Problems", "QDQ_FLAVOURS", "READABLE_SCHEMAS", "REMOVED_KEYS", "RENAMED_KEYS", "RUNTIMES", "RigConfig",
    "SCHEMA_VERSION", "SEGMENTATION_CLASSES", "SHARD_LAYOUTS",
    "STRATEGIES", "TARGET_PRECISIONS", "TRACKING_FILES", "TRACKING_OFF", "TRACKING_SCHEMES", "TRAIN_BOUNDS",
    "Target", "TrainConfig", "WorldConfig", "key_history", "migrate", "migrate_guard_settings", "temporal_problems",
]
