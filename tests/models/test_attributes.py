"""The attribute branch of the detection head (model.attribute_head): trained at box centres, decoded per class."""

import torch

from stack.config import load_pipeline
from stack.metrics.detection import ATTRIBUTES, class_attributes
from stack.models.bev_heads import DetectionHead
from stack.models.decoders import decode_attributes
from stack.models.losses import attribute_loss
from stack.models.targets import encode_detections
from stack.synthetic_batch import random_batch
from stack.ops.bev_pool import grid_cells


def _setup():
    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"], ["model.attribute_head=true"])
    batch = random_batch(pipeline, batch_size=2, seed=3)
    model = pipeline.model
    targets = encode_detections(batch.boxes, batch.box_labels, len(model.detection_classes), model.bev,
                                grid_cells(model.bev))
    return pipeline, batch, targets


def test_the_head_learns_each_boxs_attribute_at_its_centre_and_decodes_it():
    """Trained on the attribute loss alone over fixed BEV features, the branch gives back every labelled box's
    attribute at its centre cell; an untrained one does not."""
    pipeline, batch, targets = _setup()
    torch.manual_seed(0)
    grid = grid_cells(pipeline.model.bev)
    bev = torch.randn(2, 16, *grid)
    head = DetectionHead(16, len(pipeline.model.detection_classes), len(ATTRIBUTES))
    labelled = targets.valid & (batch.box_attributes >= 0)
    assert labelled.sum() >= 4

    def decoded() -> torch.Tensor:
        with torch.no_grad():
            logits = head.eval()(bev)["attribute_logits"]
        return torch.cat([decode_attributes(logits[b], targets.cell_index[b][labelled[b]],
                                            batch.box_labels[b][labelled[b]], pipeline.model.detection_classes)
                          for b in range(2)])

    expected = batch.box_attributes[labelled]
    before = decoded()
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(60):
        optimizer.zero_grad()
        loss = attribute_loss(head.train()(bev)["attribute_logits"], batch, targets)
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.1
    assert torch.equal(decoded(), expected), (decoded(), expected)
    assert not torch.equal(before, expected)


def test_a_detection_gets_only_an_attribute_its_class_can_have():
    """However the logits lean, a car is moving, stopped or parked, a pedestrian moving, sitting or standing; a class
    with no attributes (a barrier) decodes to -1, as the devkit expects of it."""
    classes = ["car", "pedestrian", "cyclist", "barrier"]
    logits = torch.zeros(len(ATTRIBUTES), 2, 2)
    logits[ATTRIBUTES.index("pedestrian.moving")] = 5.0  # the most likely attribute everywhere
    cells, labels = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 3])
    got = [ATTRIBUTES[i] if i >= 0 else None for i in decode_attributes(logits, cells, labels, classes).tolist()]
    assert got[0].startswith("vehicle.") and got[1] == "pedestrian.moving" and got[2].startswith("cycle.")
    assert got[3] is None
    assert class_attributes(classes).sum(axis=1).tolist() == [3, 3, 2, 0]


def test_boxes_without_an_attribute_add_no_loss():
    """Padding and boxes labelled -1 (a class with none, a hand-built batch) contribute nothing, and the loss keeps
    its graph so a step still runs."""
    pipeline, batch, targets = _setup()
    batch.box_attributes = torch.full_like(batch.box_labels, -1)
    logits = torch.randn(2, len(ATTRIBUTES), *grid_cells(pipeline.model.bev), requires_grad=True)
    loss = attribute_loss(logits, batch, targets)
    loss.backward()
    assert float(loss) == 0.0 and logits.grad is not None and float(logits.grad.abs().sum()) == 0.0
