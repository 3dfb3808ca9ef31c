"""The path-speed planner: a path, K speed candidates along it, and labels that come from the world."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from stack.config import load_pipeline
from stack.kinematics import along_path, speed_profile_arcs
from stack.models import build_model
from stack.models.losses import speed_candidate_targets
from stack.models.outputs import TRAINING_OUTPUTS, output_names, output_shapes
from stack.synthetic_batch import random_batch

warnings.filterwarnings("ignore", message="bev_pool: the extension")
ACCELERATIONS = [-7.0, -3.0, -1.0, 0.0, 1.5]


def path_speed_pipeline(*overrides):
    accelerations = "[" + ",".join(str(a) for a in ACCELERATIONS) + "]"
    return load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"],
                         [f"model.planning_accelerations={accelerations}", *overrides])


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    p = path_speed_pipeline()
    return p, build_model(p), random_batch(p, batch_size=2, seed=0)


def test_candidates_are_the_speed_profiles_along_the_path_and_scores_combine_both_heads(tiny):
    p, model, batch = tiny
    with torch.no_grad():
        model.planning_head.path.weight.normal_(std=0.05)  # a bent path, not the initial straight line
        model.planning_head.scorer[-1].weight.normal_(std=0.05)  # and refined anchors
        outputs = model.forward_batch(batch)
    assert set(outputs) == set(output_names(p.model)) | set(TRAINING_OUTPUTS)
    for name, shape in output_shapes(p, batch=2).items():
        assert tuple(outputs[name].shape) == shape, name
    assert outputs["plan_trajectories"].shape[1] == len(ACCELERATIONS)
    arcs = speed_profile_arcs(batch.ego_status[:, 0], torch.tensor(ACCELERATIONS), p.model.planning_steps)
    refinement = outputs["plan_arc_refinement"]
    assert refinement.abs().max() > 0.01 and refinement.abs().max() <= 2.0
    expected = along_path(outputs["plan_path"], p.model.path_spacing_m, (arcs + refinement).clamp(min=0))
    torch.testing.assert_close(outputs["plan_trajectories"], expected)
    steps = outputs["plan_path"].diff(dim=1, prepend=torch.zeros(2, 1, 2)).norm(dim=-1)
    torch.testing.assert_close(steps, torch.full_like(steps, p.model.path_spacing_m))  # points by arc length
    combined = outputs["plan_speed_logits"].log_softmax(1) + F.logsigmoid(-outputs["plan_collision_logits"])
    torch.testing.assert_close(outputs["plan_scores"], combined)


def test_a_parked_car_ahead_labels_the_fast_candidates_as_collisions_and_the_expert_speed_as_the_target(tiny):
    batch = random_batch(tiny[0], batch_size=2, seed=1)
    batch.ego_status[:] = torch.tensor([10.0, 0.0, 0.0])
    batch.bev_rotation[:] = 0.0
    batch.future_valid[:] = True
    # The expert brakes from 10 m/s to a stop 15 m on (its front bumper 18.6 m on), short of a car parked 25 m
    # ahead (rear bumper at 22.75 m).
    stopping = torch.tensor([4.6, 8.4, 11.4, 13.6, 14.8, 15.0])
    batch.future_trajectory[:] = torch.stack([stopping, torch.zeros(6)], dim=-1)
    batch.boxes[:] = 0
    batch.box_labels[:] = -1
    batch.boxes[:, 0] = torch.tensor([25.0, 0.0, 0.8, 4.5, 1.9, 1.6, 0.0, 0.0, 0.0])
    batch.box_labels[:, 0] = 0
    target, hits = speed_candidate_targets(batch, ACCELERATIONS)
    # 10 m/s: braking at 7 and 3 m/s^2 stops the rear axle 7.1 and 16.7 m on (front bumper 10.7 and 20.3 m);
    # -1, 0 and +1.5 drive on into the car.
    assert hits[0].tolist() == [False, False, True, True, True]
    assert target[0].argmax().item() == 1  # -3 m/s^2 is closest to the expert's stop
    assert torch.allclose(target.sum(1), torch.ones(2))
    batch.boxes[:, 0, 1] = 6.0  # the same car parked beside the road: nothing to hit
    assert not speed_candidate_targets(batch, ACCELERATIONS)[1].any()
    batch.boxes[:, 0, :2] = torch.tensor([21.5, 0.0])  # rear bumper 19.25 m on: a rear-axle disc would stop short
    assert speed_candidate_targets(batch, ACCELERATIONS)[1][0].tolist() == [False, True, True, True, True]


def test_the_footprint_discs_cover_the_simulated_ego_bumper_to_bumper():
    from stack.metrics.collision import FOOTPRINT_DISCS_M, FOOTPRINT_RADIUS_M
    from stack.sim.world.scene import EGO_SIZE, REAR_AXLE_OFFSET

    length, width = EGO_SIZE[:2]
    assert FOOTPRINT_RADIUS_M == pytest.approx(width / 2)
    assert FOOTPRINT_DISCS_M[-1] + FOOTPRINT_RADIUS_M == pytest.approx(REAR_AXLE_OFFSET + length / 2)
    assert FOOTPRINT_DISCS_M[0] - FOOTPRINT_RADIUS_M == pytest.approx(REAR_AXLE_OFFSET - length / 2)
    gaps = [b - a for a, b in zip(FOOTPRINT_DISCS_M, FOOTPRINT_DISCS_M[1:])]
    assert max(gaps) <= 2 * FOOTPRINT_RADIUS_M  # no gap between neighbouring discs along the car


def test_every_planner_parameter_learns_and_bf16_keeps_the_plan_in_fp32(tiny):
    p, _, batch = tiny
    torch.manual_seed(1)
    model = build_model(p)
    model.loss(model.forward_batch(batch), batch)["total"].backward()
    dead = [name for name, param in model.planning_head.named_parameters()
            if param.grad is None or not torch.isfinite(param.grad).all() or param.grad.abs().sum() == 0]
    assert dead == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model.forward_batch(batch)
        terms = model.loss(outputs, batch)
    assert outputs["plan_trajectories"].dtype == torch.float32
    assert all(torch.isfinite(terms[name]) for name in ("plan_path", "plan_speed", "plan_collision", "total"))


def test_bad_speed_vocabularies_are_refused_with_the_key_named():
    from stack.errors import StackError

    for bad in ("model.planning_accelerations=[0,0]", "model.planning_accelerations=[-30,0]"):
        with pytest.raises(StackError, match="planning_accelerations"):
            load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"], [bad])
    with pytest.raises(StackError, match="planning_modes"):
        path_speed_pipeline("model.planning_modes=3")


def test_the_drivable_target_lifts_each_cameras_road_pixels_onto_their_cells():
    """A flat world: road for |y| < 3 m, sidewalk beyond; every camera of the rig looks at it."""
    from stack.models.targets import encode_drivable
    from stack.ops.bev_pool import grid_cells
    from stack.rig import rig_matrices

    p = path_speed_pipeline()
    rig, classes = p.data.rig, p.model.segmentation_classes
    ks, poses = (torch.as_tensor(m, dtype=torch.float32)[None] for m in rig_matrices(rig))
    v, u = torch.meshgrid(torch.arange(rig.image_height) + 0.5, torch.arange(rig.image_width) + 0.5, indexing="ij")
    rays = torch.stack([(u - ks[0, :, 0, 2, None, None]) / ks[0, :, 0, 0, None, None],
                        (v - ks[0, :, 1, 2, None, None]) / ks[0, :, 1, 1, None, None], torch.ones_like(u).expand(len(ks[0]), -1, -1)],
                       dim=-1)  # (N, H, W, 3): z-depth 1
    down = torch.einsum("nij,nhwj->nhwi", poses[0, :, :3, :3], rays)[..., 2]
    depth = torch.where(down < -1e-3, -poses[0, :, None, None, 2, 3] / down, torch.zeros_like(down))  # ground z = 0
    ego = torch.einsum("nij,nhwj->nhwi", poses[0, :, :3, :3], rays * depth[..., None]) + poses[0, :, None, None, :3, 3]
    semantic = torch.where(ego[..., 1].abs() < 3.0, classes.index("road"), classes.index("sidewalk"))
    semantic = torch.where(depth > 0, semantic, classes.index("sky"))
    grid = grid_cells(p.model.bev)
    target, known = encode_drivable(depth[None].half(), semantic[None].to(torch.uint8), ks, poses, classes,
                                    p.model.bev, grid)
    cell = p.model.bev.cell_size
    centre_y = p.model.bev.y_range[0] + (torch.arange(grid[1]) + 0.5) * cell
    centre_x = p.model.bev.x_range[0] + (torch.arange(grid[0]) + 0.5) * cell
    radius = (centre_x[:, None] ** 2 + centre_y[None] ** 2).sqrt()
    near = (radius > 5) & (radius < 12)  # nearer, the car's own body hides the ground from its cameras
    road = centre_y.abs()[None].expand(grid[0], -1) < 2.5
    sidewalk = centre_y.abs()[None].expand(grid[0], -1) > 3.5
    assert known[0][near & road].float().mean() > 0.6 and known[0][near & sidewalk].float().mean() > 0.8
    assert target[0][known[0] & road].min() == 1 and target[0][known[0] & sidewalk].max() == 0


def test_the_tiny_drive_preset_trains_the_path_speed_planner_in_folders_of_its_own():
    tiny = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])
    drive = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"])
    assert drive.model.planning_accelerations and drive.data.world.drive_episodes > 0
    assert min(drive.model.planning_accelerations) < 0 < max(drive.model.planning_accelerations)
    for section in ("data", "train", "export", "dagger", "drive"):  # never the tiny recipe's runs
        key = "root" if section == "data" else "out_dir"
        assert getattr(getattr(drive, section), key) != getattr(getattr(tiny, section), key), section
    with torch.device("meta"):
        assert type(build_model(drive).planning_head).__name__ == "PathSpeedPlanningHead"


def _car_ahead(p, speed_x: float, speed_y: float = 0.0, cell: tuple = (52, 32)):
    """A BEV with one confident car at `cell` (x 20.5 m, y 0.5 m by default) whose detected velocity is given."""
    x, y = (round((r[1] - r[0]) / p.model.bev.cell_size) for r in (p.model.bev.x_range, p.model.bev.y_range))
    heatmap = torch.full((1, len(p.model.detection_classes), x, y), -10.0)
    regression = torch.randn(1, 10, x, y)  # untrained regression everywhere: must not leak onto empty road
    heatmap[0, 0, cell[0], cell[1]] = 6.0
    regression[0, 8:10, cell[0], cell[1]] = torch.tensor([speed_x, speed_y])
    return heatmap, regression


def test_the_scorer_reads_what_moves_on_the_path_along_and_across_it():
    """Motion of others (model.planning_velocity): a car 20 m ahead on a straight path reads as its own speed along
    the path at the points that reach it and 0 elsewhere; on a path that turns towards y, the same car's sideways
    motion reads as along."""
    p = path_speed_pipeline("model.temporal_frames=1", "model.planning_velocity=true")
    head = build_model(p).planning_head
    arcs = torch.linspace(0.0, 30.0, 61)[None, None]  # (1, 1, S)
    straight = torch.stack([torch.arange(1, 17) * 2.5, torch.full((16,), 0.5)], dim=-1)[None]  # y = 0.5 m
    points = along_path(straight, 2.5, arcs)
    tangent = along_path(straight, 2.5, arcs + 0.5) - points
    for speed in (0.0, 8.0):
        heatmap, regression = _car_ahead(p, speed)
        features = head._path_velocity(regression, heatmap, points, tangent)[0, 0]  # (S, 2)
        at_car = (points[0, 0, :, 0] - 20.5).abs() < 0.3
        assert features[at_car, 0].mean() == pytest.approx(speed / 10.0, abs=0.05)
        assert features[at_car, 1].abs().max() < 0.05
        far = (points[0, 0, :, 0] - 20.5).abs() > 2.5
        assert features[far].abs().max() < 1e-3
    sideways = torch.stack([torch.full((16,), 20.5), torch.arange(1, 17) * 2.5 - 20.0], dim=-1)[None]  # along +y
    points = along_path(sideways, 2.5, arcs)
    tangent = along_path(sideways, 2.5, arcs + 0.5) - points
    heatmap, regression = _car_ahead(p, 0.0, 6.0)
    features = head._path_velocity(regression, heatmap, points, tangent)[0, 0]
    at_car = (points[0, 0, :, 1] - 0.5).abs() < 0.3
    assert features[at_car, 0].mean() == pytest.approx(0.6, abs=0.05)


def test_the_planner_reads_the_detected_velocity_without_training_it():
    """The planning loss must not bend the velocity regression toward what suits the scorer: the detection loss
    alone gives it its meaning (metres per second)."""
    p = path_speed_pipeline("model.temporal_frames=1", "model.planning_velocity=true")
    torch.manual_seed(0)
    model = build_model(p)
    batch = random_batch(p, batch_size=2, seed=0)
    terms = model.loss(model.forward_batch(batch), batch)
    (terms["plan_speed"] + terms["plan_collision"]).backward()
    projection = model.planning_head.sample_projection.weight.grad
    assert projection[:, -2:].abs().sum() > 0  # the velocity features reach the scorer
    regression = model.detection_head.regression[-1].weight.grad
    assert regression is None or regression.abs().sum() == 0


def test_velocity_for_the_planner_needs_a_network_that_sees_motion():
    from stack.errors import StackError

    with pytest.raises(StackError, match="planning_velocity"):
        path_speed_pipeline("model.planning_velocity=true")  # temporal_frames 0: one frame has no motion
    with pytest.raises(StackError, match="planning_velocity"):
        load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"],
                      ["model.temporal_frames=1", "model.planning_velocity=true"])  # the regression planner
