"""Decoders invert the target encoders: boxes, depth, classes and plans come back unchanged."""

import math
import warnings

import numpy as np
import pytest
import torch

from stack.batch import IGNORE_INDEX
from stack.config import load_pipeline
from stack.models.decoders import circle_nms, decode_depth, decode_detections, decode_plan, decode_segmentation
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


def centerpoint_circle_nms(centres, scores, labels, radii):
    """CenterPoint's `circle_nms` (det3d/core/utils/circle_nms_jit.py) transcribed, per class: the oracle. Its
    threshold is a squared distance, hence radius ** 2."""
    keep = np.zeros(len(scores), bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        order = members[np.argsort(-scores[members], kind="stable")]
        suppressed = np.zeros(len(scores), bool)
        for rank, i in enumerate(order):
            if suppressed[i]:
                continue
            keep[i] = True
            for j in order[rank + 1:]:
                if not suppressed[j] and ((centres[i] - centres[j]) ** 2).sum() <= radii[label] ** 2:
                    suppressed[j] = True
    return keep


@pytest.mark.parametrize("seed", range(4))
def test_circle_nms_is_centerpoints_greedy_suppression(seed):
    """Crowded boxes of three classes make long suppression chains, where suppressing by every higher-scoring
    box (not only the kept ones) would differ from the greedy answer."""
    rng = np.random.default_rng(seed)
    centres, scores, labels = rng.uniform(0, 8, (80, 2)), rng.random(80), rng.integers(0, 3, 80)
    radii = np.array([2.0, 1.0, 0.42])
    keep = circle_nms(torch.from_numpy(centres), torch.from_numpy(scores), torch.from_numpy(labels),
                      torch.from_numpy(radii))
    expected = centerpoint_circle_nms(centres, scores, labels, radii)
    assert keep.tolist() == expected.tolist()
    assert 0 < expected.sum() < 80


def test_circle_nms_keeps_what_a_suppressed_box_would_have_suppressed():
    """A (0.9) suppresses B (0.8, 1.5 m away); B is gone, so C (0.7, 1.5 m beyond B, 3 m from A) stays."""
    centres = torch.tensor([[0.0, 0.0], [1.5, 0.0], [3.0, 0.0], [0.1, 0.0]])
    scores, labels = torch.tensor([0.9, 0.8, 0.7, 0.95]), torch.tensor([0, 0, 0, 1])
    keep = circle_nms(centres, scores, labels, torch.tensor([2.0, 2.0]))
    assert keep.tolist() == [True, False, True, True]  # the other class's box suppresses nothing of class 0


def test_circle_nms_exports_to_onnx_with_tensorrt_native_ops(tmp_path):
    """Fixed shapes, no loop over boxes: the legacy exporter unrolls it into operators TensorRT imports natively,
    and ONNX Runtime keeps what PyTorch keeps."""
    import onnx
    import onnxruntime

    from stack.deploy.trt_ops import tensorrt_problems

    class CircleNms(torch.nn.Module):
        def forward(self, centres, scores, labels):
            return circle_nms(centres, scores, labels, torch.tensor([2.0, 0.5]))

    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    rng = np.random.default_rng(0)

    def boxes(n=24):
        return (torch.from_numpy(rng.uniform(0, 5, (n, 2)).astype(np.float32)),
                torch.from_numpy(rng.random(n).astype(np.float32)), torch.from_numpy(rng.integers(0, 2, n)))

    path = tmp_path / "circle_nms.onnx"
    torch.onnx.export(CircleNms(), boxes(), str(path), input_names=["centres", "scores", "labels"],
                      output_names=["keep"], opset_version=17, dynamo=False)
    assert tensorrt_problems(onnx.load(str(path))) == []
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for _ in range(3):
        centres, scores, labels = boxes()
        got = session.run(["keep"], {"centres": centres.numpy(), "scores": scores.numpy(), "labels": labels.numpy()})
        assert got[0].tolist() == circle_nms(centres, scores, labels, torch.tensor([2.0, 0.5])).tolist()


def test_circle_nms_removes_side_by_side_duplicates_that_iou_nms_keeps(tiny):
    """Two peaks of one car 1.5 m apart sideways overlap too little for IoU NMS (BEV IoU ~0.12 < nms_iou 0.2);
    circle NMS with the car's 2 m radius keeps one; the same pair of pedestrians (0.42 m) stays two."""
    import dataclasses

    boxes = torch.tensor([[[10.0, 10.0, 0.8, 4.5, 1.9, 1.6, 0.0, 0.0, 0.0]]])

    def decoded(label, radii):
        outputs, targets = encoded_outputs(boxes, torch.tensor([[label]]), tiny)
        centre = int(targets.cell_index[0, 0])
        heat, regression = outputs["heatmap"].flatten(2), outputs["box_regression"].flatten(2)
        heat[0, label, centre + 2] = 2.0  # a weaker peak two cells along y
        regression[0, :, centre + 2] = regression[0, :, centre]
        regression[0, 1, centre + 2] -= 0.5  # its centre 1.5 cells (1.5 m) from the first
        model = dataclasses.replace(tiny.model, circle_nms_radius_m=radii)
        return decode_detections(outputs, dataclasses.replace(tiny, model=model))[0]

    radii = {"car": 2.0, "truck": 3.5, "pedestrian": 0.42, "cyclist": 0.92}
    assert len(decoded(0, {}).boxes) == 2
    kept = decoded(0, radii)
    assert len(kept.boxes) == 1 and kept.boxes[0, 1] == pytest.approx(10.0, abs=1e-4) and kept.scores[0] > 0.99
    assert len(decoded(2, radii).boxes) == 2


def test_circle_nms_radii_must_name_every_class():
    from stack.errors import StackError

    with pytest.raises(StackError, match=r"circle_nms_radius_m.*missing \['cyclist', 'truck'\]; unknown \['bus'\]"):
        load_pipeline(["configs/pipeline.yaml"], ["model.circle_nms_radius_m={car: 2, pedestrian: 0.4, bus: 3}"])
    assert load_pipeline(["configs/pipeline.yaml"]).model.circle_nms_radius_m == {}  # off: IoU NMS as before


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
