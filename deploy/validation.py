"""The samples deploy works on: calibration and sensitivity from the training split, scoring from validation.

Three sets, disjoint by construction, each for one job:

- **calibration** (`export.calibration_samples`): INT8 activation ranges are fitted on frames
  from the *training* split, spread evenly over it (so over its scenes), as a deployment would
  calibrate on data it has rather than on the frames that will judge it;
- **sensitivity** (`export.sensitivity_samples`): the per-layer ranking of the accuracy gate's
  fp32 fallback, on other training frames spread between the calibration ones, so the layers
  kept fp32 are not chosen on the frames that score them;
- **accuracy** (`export.accuracy_samples`): the held-out validation split (whole scenes never
  seen in training, `stack data make`), read in order; every head is scored there, and the gate's
  bootstrap resamples its scenes (`accuracy_scenes`), not its correlated frames.

Each set records its sample ids (`split/index` in the split's unshuffled order), so the
bundle shows that no frame serves two jobs. Both splits are read without augmentation.
Too few training frames to calibrate, or no validation frame, is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stack.batch import Batch
from stack.pipeline import Pipeline


@dataclass
class DeploySamples:
    calibration: list
    """Single-sample Batches from the training split for INT8 calibration."""
    sensitivity: list
    """Single-sample Batches from the training split (not calibration) for the sensitivity ranking."""
    accuracy: list
    """Single-sample Batches from the validation split that the accuracy gate scores."""
    ids: dict
    """{"calibration" | "sensitivity" | "accuracy": ["train/17", ...]}."""
    source: str
    accuracy_scenes: list | None = None
    """The scene (or closed-loop episode) of each accuracy frame, which the gate's bootstrap resamples whole;
    None where the shards name no scenes (clips)."""


def load_validation(pipeline: Pipeline, count: int) -> tuple[list, str]:
    """(single-sample Batches, up to `count` of them, in split order; a description of the source)."""
    samples = read_split(pipeline, "val", range(count))
    return [batch for _, batch in samples], f"validation split of {pipeline.data.root} ({pipeline.data.backend} loader)"


def read_split(pipeline: Pipeline, split: str, indices) -> list[tuple[int, Batch]]:
    """(index, single-sample Batch) for the wanted indices of `split` in its unshuffled order (fewer when
    the split is shorter); reading stops after the last one wanted."""
    from stack.data.loader import build_loader

    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        return []
    loader = build_loader(pipeline, split, rank=0, world_size=1, shuffle=False, augment=False)
    found, position, keep = [], 0, set(wanted)
    for batch in loader:
        for sample in split_batch(batch):
            if position in keep:
                found.append((position, sample))
            position += 1
        if position > wanted[-1]:
            break
    return found


def split_size(pipeline: Pipeline, split: str) -> int:
    """Frames in `split` according to the dataset manifest (a clip shard's sample is a scene of frames_per_clip)."""
    from stack.data.loader import read_manifest, split_shards

    root = pipeline.data.root
    manifest = read_manifest(root)
    frames = manifest.get("frames_per_clip", 1) if manifest.get("layout") == "clips" else 1
    return frames * sum(count for _, count in split_shards(manifest, root, split))


def split_batch(batch: Batch) -> list[Batch]:
    """One Batch per sample (graphs are exported at batch 1)."""
    size = batch.images.shape[0]
    return [Batch(**{name: tensor[i:i + 1] for name, tensor in batch.tensors().items()}) for i in range(size)]


def spread(total: int, count: int) -> list[int]:
    """`count` indices spread evenly over range(total) (all of them when count >= total)."""
    if count >= total:
        return list(range(total))
    return sorted(set(np.linspace(0, total - 1, count).round().astype(int).tolist()))


def deploy_samples(pipeline: Pipeline) -> DeploySamples:
    """Calibration and sensitivity frames from the training split, accuracy frames from validation."""
    from stack.errors import StackError

    cfg = pipeline.export
    train_total = split_size(pipeline, "train")
    picked = spread(train_total, cfg.calibration_samples + cfg.sensitivity_samples)
    spare = min(cfg.sensitivity_samples, len(picked) - cfg.calibration_samples)  # never at calibration's expense
    chosen = set(spread(len(picked), spare)) if spare > 0 else set()
    sensitivity_ids = [picked[i] for i in sorted(chosen)]
    calibration_ids = [index for i, index in enumerate(picked) if i not in chosen]
    train = dict(read_split(pipeline, "train", picked))
    calibration = [train[i] for i in calibration_ids if i in train]
    if len(calibration) < cfg.calibration_samples:
        raise StackError(f"calibration set too small: export.calibration_samples asks for {cfg.calibration_samples} "
                         f"frames of the training split (plus export.sensitivity_samples {cfg.sensitivity_samples} "
                         f"others), found {train_total} in {pipeline.data.root}. Render more training data "
                         f"(data.world.scenes) or lower export.calibration_samples.")
    sensitivity = [train[i] for i in sensitivity_ids if i in train]
    accuracy = read_split(pipeline, "val", range(cfg.accuracy_samples))
    if not accuracy:
        raise StackError(f"no validation frames in {pipeline.data.root}: the accuracy gate scores the validation "
                         f"split. Render one with data.world.val_fraction > 0 (stack data make).")
    val_total = split_size(pipeline, "val")
    scenes = _scenes_of(pipeline, [i for i, _ in accuracy])
    source = (f"{pipeline.data.root} ({pipeline.data.backend} loader): calibration {len(calibration)} and sensitivity "
              f"{len(sensitivity)} frames spread over the {train_total}-frame training split; accuracy "
              f"{len(accuracy)} of the {val_total} held-out validation frames"
              + (f" ({len(set(scenes))} scenes)" if scenes else ""))
    ids = {"calibration": [f"train/{i}" for i in calibration_ids], "sensitivity": [f"train/{i}" for i in sensitivity_ids],
           "accuracy": [f"val/{i}" for i, _ in accuracy]}
    return DeploySamples(calibration, sensitivity, [batch for _, batch in accuracy], ids, source, scenes)


def _scenes_of(pipeline: Pipeline, positions: list) -> list:
    """The scene of each validation frame at `positions` (split order)."""
    from stack.data.sequences import split_sequences

    scenes = split_sequences(pipeline, "val")
    return [scenes[i] for i in positions]


def calibration_and_accuracy(pipeline: Pipeline) -> tuple[list, list, str]:
    """(calibration Batches from the training split, accuracy Batches from validation, description)."""
    samples = deploy_samples(pipeline)
    return samples.calibration, samples.accuracy, samples.source
