"""Batch's dense labels travel narrow (depth float16, semantics uint8) and are widened only where arithmetic needs it."""

import pytest
import torch
from dataclasses import replace

from stack.batch import IGNORE_INDEX
from stack.config import load_pipeline
from stack.data import build_loader
from stack.data.samples import ClassMaps
from stack.errors import StackError


@pytest.mark.parametrize("backend", ["torch", "dali"])
@pytest.mark.parametrize("augment", [False, True])
def test_both_backends_yield_narrow_dense_labels(dataset, small_pipeline, backend, augment):
    pipeline, _ = dataset
    chosen = small_pipeline(pipeline.data.root, f"data.backend={backend}", "data.augment.resize_scale=[0.8,1.2]")
    batch = next(iter(build_loader(chosen, "train", 0, 1, augment=augment)))
    assert (batch.depth.dtype, batch.semantic.dtype) == (torch.float16, torch.uint8)
    assert batch.mismatches(chosen) == []
    assert (batch.depth > 0).any() and (batch.semantic != IGNORE_INDEX).any()


def test_mismatches_names_a_widened_field(dataset):
    from stack.synthetic_batch import random_batch

    pipeline, _ = dataset
    batch = random_batch(pipeline)
    assert batch.mismatches(pipeline) == []
    wide = replace(batch, depth=batch.depth.float(), semantic=batch.semantic.long())
    found = wide.mismatches(pipeline)
    assert any(m.startswith("depth: expected float16") and "found float32" in m for m in found)
    assert any(m.startswith("semantic: expected uint8") and "found int64" in m for m in found)


def test_the_loss_of_a_narrow_batch_equals_the_loss_of_the_widened_batch():
    from stack.models import build_model
    from stack.models.losses import multitask_loss
    from stack.synthetic_batch import random_batch

    pipeline = load_pipeline(overrides=["data.rig.image_width=128", "data.rig.image_height=64", "model.backbone=resnet10t",
                                        "model.neck_channels=16", "model.bev_channels=16"])
    torch.manual_seed(0)
    model = build_model(pipeline).eval()
    narrow = random_batch(pipeline, batch_size=2)
    wide = replace(narrow, depth=narrow.depth.float(), semantic=narrow.semantic.long())
    with torch.no_grad():
        outputs = model.forward_batch(narrow)
        narrow_terms = multitask_loss(outputs, narrow, pipeline)
        wide_terms = multitask_loss(outputs, wide, pipeline)
    assert narrow_terms["depth"] > 0 and narrow_terms["segmentation"] > 0
    for name, value in wide_terms.items():
        assert torch.equal(narrow_terms[name], value), name


def test_a_class_list_that_does_not_fit_uint8_is_refused(dataset):
    pipeline, manifest = dataset

    def classes(count: int):
        return load_pipeline(overrides=[f"model.segmentation_classes=[{','.join(f'c{i}' for i in range(count))}]"])

    ClassMaps.build(manifest, classes(255))  # ids 0..254 all lie below IGNORE_INDEX (255), as the message says
    with pytest.raises(StackError, match=r"segmentation_classes: got 256; at most 255 classes \(semantic ids are "
                                         r"stored as uint8"):  # the schema refuses it before any loader is built
        ClassMaps.build(manifest, classes(256))
