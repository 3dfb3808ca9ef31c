"""Validation samples for calibration, the accuracy gate and timing, from the validation shards.

The validation split holds whole scenes never seen in training (`stack data make`). Deploy
reads it in order, without augmentation, and splits it into a calibration part (the first
`export.calibration_samples`) and an accuracy part (the next `export.accuracy_samples`),
so INT8 ranges are never fitted on the samples that judge them — unless the split is too
small for both, in which case the accuracy part reuses calibration samples and the report
says so. Too few samples to calibrate at all is an error.
"""

from __future__ import annotations

from dataclasses import fields

from stack.batch import Batch
from stack.deploy.quantize import check_calibration_set
from stack.pipeline import Pipeline


def load_validation(pipeline: Pipeline, count: int) -> tuple[list, str]:
    """(single-sample Batches, up to `count` of them, in split order; a description of the source)."""
    from stack.data.loader import build_loader

    loader = build_loader(pipeline, "val", shuffle=False, augment=False)
    samples = []
    for batch in loader:
        samples.extend(split_batch(batch))
        if len(samples) >= count:
            break
    return samples[:count], f"validation split of {pipeline.data.root} ({pipeline.data.backend} loader)"


def split_batch(batch: Batch) -> list[Batch]:
    """One Batch per sample (graphs are exported at batch 1)."""
    size = batch.images.shape[0]
    return [Batch(**{f.name: getattr(batch, f.name)[i:i + 1] for f in fields(batch)}) for i in range(size)]


def calibration_and_accuracy(pipeline: Pipeline) -> tuple[list, list, str]:
    """(calibration Batches, accuracy Batches, description) for the export settings."""
    cfg = pipeline.export
    samples, source = load_validation(pipeline, cfg.calibration_samples + cfg.accuracy_samples)
    check_calibration_set(samples, cfg.calibration_samples)
    calibration = samples[:cfg.calibration_samples]
    rest = samples[cfg.calibration_samples:]
    if len(rest) >= cfg.accuracy_samples:
        return calibration, rest, f"{source}: {len(calibration)} calibration + {len(rest)} held-out accuracy samples"
    accuracy = samples[-cfg.accuracy_samples:]
    return calibration, accuracy, (f"{source}: only {len(samples)} samples, so the {len(accuracy)} accuracy samples "
                                   f"overlap the {len(calibration)} calibration samples")
