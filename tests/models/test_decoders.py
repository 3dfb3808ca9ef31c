"""Decoders invert the target encoders: boxes, depth, classes and plans come back unchanged."""

import math

import pytest
import torch

from stack.batch import IGNORE_INDEX
from stack.config import load_pipeline
from stack.models.decoders import decode_depth, decode_detections, decode_plan, decode_segmentation
from stack.models.targets import encode_depth, encode_detections, gaussian_radius
from stack.ops.bev_pool import depth_bin_centres, grid_cells


@pytest.fixture(scope="module")
def tiny():
    return load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])


def encoded_outputs(boxes, labels, pipeline):
    """Network outputs that say exactly what the encoder wrote: the decoder must read it back."""
    model = pipeline.model
    grid = grid_cells(model.bev)
    targets = encode_detections(boxes, labels, len(model.detection_classes), model.bev, grid)
    heat = targets.heatmap.clamp(1e-6, 1 - 1e-6)
    regression = torch.zeros(boxes.shape[0], 10, grid[0] * grid[1])
    for b in range(boxes.shape[0]):
        valid = targets.valid[b]
        regression[b][:, targets.cell_index[b][valid]] = targets.regression[b][valid].T
    return {"heatmap": torch.log(heat / (1 - heat)), "box_regression": regression.view(-1, 10, *grid)}, targets


def test_detection_decoder_round_trips_encoded_boxes(tiny):
    boxes = torch.tensor([[[10.3, -7.9, 0.8, 4.5, 1.9, 1.6, 0.7, 3.0, -1.0],
                           [-20.6, 15.2, 1.5, 8.0, 2.6, 3.2, -2.9, 0.0, 0.5],
                           [28.1, 29.7, 0.9, 0.7, 0.7, 1.75, 1.2, 1.0, 1.0],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0]],
                          [[-30.0, -3.3, 0.8, 1.8, 0.7, 1.6, 3.0, 0.0, 0.0],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0]]])
    labels = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1]])
    outputs, _ = encoded_outputs(boxes, labels, tiny)
    decoded = decode_detections(outputs, tiny)
    for b, det in enumerate(decoded):
        real = labels[b] >= 0
        assert len(det.boxes) == int(real.sum())
        order = torch.argsort(det.boxes[:, 0])
        expected = boxes[b][real][torch.argsort(boxes[b][real][:, 0])]
        torch.testing.assert_close(det.boxes[order], expected, atol=1e-4, rtol=1e-4)
        assert sorted(det.labels.tolist()) == sorted(labels[b][real].tolist())
        assert torch.all(det.scores > 0.99)


def test_heatmap_peaks_at_the_centre_cell_with_centerpoint_radius(tiny):
    boxes = torch.tensor([[[10.3, -7.9, 0.8, 4.5, 1.9, 1.6, 0.0, 0.0, 0.0]]])
    targets = encode_detections(boxes, torch.tensor([[0]]), 4, tiny.model.bev, grid_cells(tiny.model.bev))
    bev = tiny.model.bev
    cell = bev.cell_size
    cx, cy = math.floor((10.3 - bev.x_range[0]) / cell), math.floor((-7.9 - bev.y_range[0]) / cell)
    assert targets.heatmap[0, 0, cx, cy] == 1.0 and targets.heatmap[0, 1:].sum() == 0
    assert int(targets.cell_index[0, 0]) == cx * grid_cells(tiny.model.bev)[1] + cy
    # CenterPoint: radius = max(2, int(gaussian_radius((l, w) in cells, 0.1))), a (2r+1)^2 patch
    radius = max(2, int(gaussian_radius(torch.tensor(4.5 / cell), torch.tensor(1.9 / cell))))
    nonzero = (targets.heatmap[0, 0] > 0).nonzero()
    assert (nonzero[:, 0] - cx).abs().max() == radius and (nonzero[:, 1] - cy).abs().max() == radius


def test_decoder_suppresses_duplicates_and_respects_threshold(tiny):
    boxes = torch.tensor([[[10.0, 10.0, 0.8, 4.5, 1.9, 1.6, 0.0, 0.0, 0.0]]])
    outputs, targets = encoded_outputs(boxes, torch.tensor([[0]]), tiny)
    # a second, weaker peak two cells away describing an overlapping box of the same class
    cell = int(targets.cell_index[0, 0]) + 2 * grid_cells(tiny.model.bev)[1]
    heat = outputs["heatmap"].flatten(2)
    heat[0, 0, cell] = 2.0
    regression = outputs["box_regression"].flatten(2)
    regression[0, :, cell] = regression[0, :, int(targets.cell_index[0, 0])]
    regression[0, 0, cell] -= 1.0  # its centre one cell (1.6 m) from the first: BEV IoU ~0.5
    assert len(decode_detections(outputs, tiny)[0].boxes) == 1
    outputs["heatmap"][:] = -10.0
    assert len(decode_detections(outputs, tiny)[0].boxes) == 0


def test_depth_decoder_returns_bin_centres_for_confident_bins(tiny):
    depth = torch.full((1, 6, 128, 256), 0.0)
    depth[..., :64, :] = 10.2
    depth[..., 64:, :] = 30.7
    bins = encode_depth(depth, tiny.model.feature_stride, tiny.model.depth)
    assert (bins != IGNORE_INDEX).all()
    logits = torch.nn.functional.one_hot(bins, tiny.model.depth.bins).permute(0, 1, 4, 2, 3).float() * 50
    decoded = decode_depth({"depth_logits": logits}, tiny)
    centres = depth_bin_centres(tiny.model.depth, dtype=torch.float32)
    step = centres[1] - centres[0]
    assert decoded.shape == depth.shape
    assert (decoded[..., 10:50, :] - 10.2).abs().max() <= step / 2 + 1e-4
    assert (decoded[..., 80:, :] - 30.7).abs().max() <= step / 2 + 1e-4


def test_depth_encoder_takes_the_nearest_valid_depth_and_ignores_the_rest(tiny):
    depth = torch.zeros(1, 1, 16, 16)
    depth[0, 0, 3, 5] = 20.0
    depth[0, 0, 7, 2] = 12.0
    depth[0, 0, 0, 0 + 8] = 200.0  # beyond max_m
    bins = encode_depth(depth, 8, tiny.model.depth)
    width = (tiny.model.depth.max_m - tiny.model.depth.min_m) / tiny.model.depth.bins
    assert bins[0, 0, 0, 0] == int((12.0 - tiny.model.depth.min_m) // width)
    assert bins[0, 0, 0, 1] == IGNORE_INDEX and bins[0, 0, 1, 0] == IGNORE_INDEX


def test_segmentation_and_plan_decoders(tiny):
    labels = torch.randint(0, 10, (1, 6, 16, 32))
    logits = torch.nn.functional.one_hot(labels, 10).permute(0, 1, 4, 2, 3).float()
    classes = decode_segmentation({"seg_logits": logits}, tiny)
    assert classes.shape == (1, 6, 128, 256) and classes.dtype == torch.int64
    torch.testing.assert_close(classes[..., 4::8, 4::8], labels)
    plans = torch.randn(2, 6, 6, 2)
    scores = torch.tensor([[0.0, 5.0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 9.0]])
    best, confidence = decode_plan({"plan_trajectories": plans, "plan_scores": scores})
    torch.testing.assert_close(best, torch.stack([plans[0, 1], plans[1, 5]]))
    assert torch.all(confidence > 0.9)
