"""The object-token planner branch: it decodes in the graph what the host decoder finds, starts as the planner
without it, exports to ONNX end to end, and learns from object-level states to brake for a stopped car it detects
and not for a detection whose kind it has learned to distrust."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stack.config import load_pipeline
from stack.kinematics import speed_profile_arcs
from stack.models import build_model
from stack.models.decoders import decode_detections
from stack.models.object_planner import ObjectPlanner
from stack.synthetic_batch import random_batch

warnings.filterwarnings("ignore", message="bev_pool: the extension")
DRIVE = ["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"]
ACCELERATIONS = [-7.0, -5.0, -3.5, -2.5, -1.5, -0.75, 0.0, 0.75, 1.5, 2.5]
RANGES = ((-32.0, 32.0), (-32.0, 32.0))


def test_object_tokens_are_the_detections_the_host_decoder_finds():
    """Three separated peaks of three classes: the in-graph top-k decoding gives the boxes, scores and classes of
    `decode_detections` (before its NMS, which separated peaks survive), and masks the empty rest."""
    pipeline = load_pipeline(DRIVE)
    torch.manual_seed(0)
    heatmap = torch.full((1, 4, 64, 64), -12.0)
    for cls, (x, y, logit) in enumerate([(40, 30, 2.0), (10, 50, 0.5), (33, 33, -1.0)]):
        heatmap[0, cls, x, y] = logit
    regression = torch.randn(1, 10, 64, 64) * 0.3
    branch = ObjectPlanner(4, 16, 6, RANGES, pipeline.model.bev.cell_size, pipeline.model.score_threshold)
    boxes, scores, labels = branch.detections(heatmap, regression)
    host = decode_detections({"heatmap": heatmap, "box_regression": regression}, pipeline)[0]
    valid = scores[0] >= branch.min_score
    assert int(valid.sum()) == len(host.scores) == 3
    torch.testing.assert_close(scores[0, valid], host.scores)
    torch.testing.assert_close(boxes[0, valid], host.boxes)
    assert labels[0, valid].tolist() == host.labels.tolist() == [0, 1, 2]


def test_a_network_with_the_branch_starts_as_the_planner_without_it():
    """The branch's last layers start at zero: adding it to a trained recipe changes no plan until it learns."""
    torch.manual_seed(0)
    plain = build_model(load_pipeline(DRIVE, ["model.planning_objects=0"]))
    with_objects_pipeline = load_pipeline(DRIVE, ["model.planning_objects=16"])
    with_objects = build_model(with_objects_pipeline)
    missing, unexpected = with_objects.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(name.startswith("planning_head.objects.") for name in missing)
    batch = random_batch(with_objects_pipeline, batch_size=2, seed=3)
    plain.eval(), with_objects.eval()
    with torch.no_grad():
        a, b = plain.forward_batch(batch), with_objects.forward_batch(batch)
    torch.testing.assert_close(a["plan_scores"], b["plan_scores"])
    torch.testing.assert_close(a["plan_trajectories"], b["plan_trajectories"])
    with torch.no_grad():  # and it is in the forward pass: once its gain moves, the scores do
        with_objects.planning_head.objects.collision_gain.fill_(1.0)
        moved = with_objects.forward_batch(batch)["plan_scores"]
    assert (moved - a["plan_scores"]).abs().max() > 1e-3


def test_an_empty_road_corrects_nothing_whatever_the_token_count():
    """Masked tokens (below the score threshold) add nothing: the collision correction of a frame without
    detections is exactly 0 for any gain and any N, so no count of empty slots reads as evidence."""
    torch.manual_seed(0)
    for tokens in (1, 16, 128):
        branch = ObjectPlanner(4, tokens, 6, RANGES, 1.0, 0.1)
        for parameter in branch.parameters():
            torch.nn.init.normal_(parameter, std=0.5)
        points, directions, own, _ = _straight_candidates(torch.tensor([8.0, 3.0]))
        boxes = torch.randn(2, tokens, 9)
        with torch.no_grad():
            out = branch.score(boxes, torch.full((2, tokens), 0.05), torch.zeros(2, tokens, dtype=torch.long),
                               points, directions, own)
        assert torch.equal(out[..., 1], torch.zeros_like(out[..., 1])), tokens
        assert torch.isfinite(out).all()


def test_the_exported_graph_computes_the_object_branch():
    """Top-k decoding, gathers and attention export with the legacy exporter at the pipeline's opset, every node one
    TensorRT imports natively (the orin target's import check), and ONNX Runtime computes what torch does."""
    import io

    import onnx
    import onnxruntime as ort

    from stack.deploy.trt_ops import tensorrt_problems

    torch.manual_seed(0)
    branch = ObjectPlanner(4, 16, 6, RANGES, 1.0, 0.1).eval()
    for parameter in branch.parameters():  # a trained branch, not the zero start
        torch.nn.init.normal_(parameter, std=0.2)
    inputs = _inputs(batch=2)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(branch, inputs, buffer, opset_version=load_pipeline(DRIVE).export.opset, dynamo=False,
                          input_names=["heatmap", "box_regression", "points", "directions", "own"])
    assert tensorrt_problems(onnx.load_from_string(buffer.getvalue())) == []
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    names = ["heatmap", "box_regression", "points", "directions", "own"]
    assert [i.name for i in session.get_inputs()] == names, "every input reaches the graph"
    got = session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})[0]
    with torch.no_grad():
        expected = branch(*inputs).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _inputs(batch: int):
    heatmap = torch.randn(batch, 4, 64, 64) - 3.0
    regression = torch.randn(batch, 10, 64, 64) * 0.5
    speed = torch.rand(batch) * 10.0
    points, directions, own, _ = _straight_candidates(speed)
    return heatmap, regression, points, directions, own


def _straight_candidates(speed: torch.Tensor):
    """(B, K, T, 2) waypoints of the speed candidates along a straight path ahead, (B, K, T, 2) its direction, and
    (B, K, 3) the candidates' own features (acceleration, ego speed and acceleration, as the scorer reads them)."""
    accelerations = torch.tensor(ACCELERATIONS)
    arcs = speed_profile_arcs(speed, accelerations, 6)
    points = torch.stack([arcs, torch.zeros_like(arcs)], dim=-1)
    directions = torch.zeros_like(points)
    directions[..., 0] = 1.0
    k = len(ACCELERATIONS)
    own = torch.stack([accelerations.expand(len(speed), k) / 5.0, (speed / 10.0)[:, None].expand(-1, k),
                       torch.zeros(len(speed), k)], dim=-1)
    return points, directions, own, arcs



def _object_states(count: int, generator: torch.Generator):
    """Object-level states without rendering: an ego on a straight road at 4-12 m/s, one detection ahead on its
    lane, 6-40 m on, standing or driving away slower than the ego, and in the second slot either nothing (a masked
    token) or a car beside the road (5-15 m to the side). Half the lane detections are cars (a real road user,
    score 0.35-0.9); half are a kind of false positive our detector makes (a pedestrian-class peak, score 0.05-0.3,
    with nothing there). Collision label per candidate: its front bumper reaches the lane car's rear within the
    horizon."""
    speed = 4.0 + 8.0 * torch.rand(count, generator=generator)
    points, directions, own, arcs = _straight_candidates(speed)
    real = torch.rand(count, generator=generator) < 0.5
    distance = 6.0 + 34.0 * torch.rand(count, generator=generator)
    moving = torch.rand(count, generator=generator) < 0.5
    velocity = torch.where(moving, speed * torch.rand(count, generator=generator), torch.zeros(count))
    boxes = torch.zeros(count, 2, 9)
    boxes[:, :, 3:6] = torch.tensor([4.5, 1.9, 1.6])
    boxes[:, 0, 0], boxes[:, 0, 1] = distance, torch.rand(count, generator=generator) * 2.0 - 1.0
    boxes[:, 0, 7] = velocity
    side = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
    boxes[:, 1, 0] = 40.0 * torch.rand(count, generator=generator)
    boxes[:, 1, 1] = side * (5.0 + 10.0 * torch.rand(count, generator=generator))
    lane_score = torch.where(real, 0.35 + 0.55 * torch.rand(count, generator=generator),
                             0.05 + 0.25 * torch.rand(count, generator=generator))
    beside = torch.where(torch.rand(count, generator=generator) < 0.5, 0.35 + 0.55 * torch.rand(count, generator=generator),
                         torch.zeros(count))
    scores = torch.stack([lane_score, beside], dim=1)
    labels = torch.stack([torch.where(real, 0, 2), torch.zeros(count, dtype=torch.long)], dim=1)
    times = 0.5 * torch.arange(1, 7, dtype=torch.float32)
    rear = distance[:, None] + velocity[:, None] * times - 2.25  # (B, T)
    hits = ((arcs + 2.5) >= rear[:, None]).any(dim=-1) & real[:, None]  # (B, K)
    return (boxes, scores, labels, points, directions, own), hits


@pytest.fixture(scope="module")
def trained_branch():
    """The branch trained for its collision term on object-level states (seconds on one core), beside a learned
    constant that stands in for the scorer's own collision logit (the branch corrects it)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    branch = ObjectPlanner(4, 2, 6, RANGES, 1.0, 0.02, width=32)
    scorer = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.Adam([*branch.parameters(), scorer], lr=1e-2)
    for _ in range(600):
        inputs, hits = _object_states(128, generator)
        loss = F.binary_cross_entropy_with_logits(scorer + branch.score(*inputs)[..., 1], hits.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return branch.eval(), float(scorer.detach())


def _collision_probabilities(trained, distance: float, score: float, label: int, speed: float = 10.0,
                             lateral: float = 0.0):
    branch, scorer = trained
    points, directions, own, _ = _straight_candidates(torch.tensor([speed]))
    boxes = torch.zeros(1, 1, 9)
    boxes[0, 0, 0], boxes[0, 0, 1] = distance, lateral
    boxes[0, 0, 3:6] = torch.tensor([4.5, 1.9, 1.6])
    with torch.no_grad():
        logits = branch.score(boxes, torch.tensor([[score]]), torch.tensor([[label]]), points, directions, own)
    return dict(zip(ACCELERATIONS, (scorer + logits[0, :, 1]).sigmoid().tolist()))


def test_the_learned_branch_brakes_for_a_stopped_car_it_detects(trained_branch):
    """At 10 m/s, a car standing 16 m ahead: driving on (0 m/s^2 runs 30 m in 3 s) collides, braking at 7 m/s^2
    (stops in 7.1 m) does not; the candidate the branch lets drive brakes."""
    p = _collision_probabilities(trained_branch, 16.0, 0.8, 0)
    assert p[0.0] > 0.8 and p[2.5] > 0.8, p
    assert p[-3.5] > 0.5, p  # reaches 16.8 m against the car's rear at 13.75 m: a collision by 3 m
    assert p[-7.0] < 0.2, p  # stops with its bumper at 9.6 m
    clear = [a for a, chance in p.items() if chance < 0.5]
    assert clear and max(clear) <= -5.0, p


def test_the_learned_branch_does_not_brake_for_a_detection_it_learned_to_distrust(trained_branch):
    """The same place, a low-scoring pedestrian-class peak (the false positives of its states): no candidate is
    judged a collision, so the plan does not brake for it; nor for a car far ahead of what 3 s reach. (A car
    beside the road alone is not asserted: these states always hold a lane detection, and trained on them the
    branch reads a lone token beside the road as a collision: docs/log/2026-12-02_object-tokens.md.)"""
    assert max(_collision_probabilities(trained_branch, 16.0, 0.15, 2).values()) < 0.2
    assert max(_collision_probabilities(trained_branch, 38.0, 0.8, 0, speed=6.0).values()) < 0.2
