"""The plan guard: the planner's best candidate that runs into none of the network's own detections."""

import math

import numpy as np
import pytest
import torch

from stack.config import load_pipeline
from stack.kinematics import along_path, speed_profile_arcs
from stack.models.plan_guard import (Odometry, PlanGuard, braking_after_reaction, candidate_arcs, colliding_candidates,
                                     depth_support, guarded_choice, segmentation_support)
from stack.pipeline.guard_config import GUARD_EMERGENCY_DECELERATION

ACCELERATIONS = [-7.0, -3.0, -1.0, 0.0, 1.5]
CAR = [4.5, 1.9, 1.6]


def candidates(speed: float, bend: float = 0.0) -> torch.Tensor:
    """(K, 6, 2): the constant-acceleration candidates along one path from `speed` m/s (bending by `bend` rad/point)."""
    heading = torch.full((16,), bend).cumsum(0)
    path = (torch.stack([torch.cos(heading), torch.sin(heading)], dim=-1) * 2.5).cumsum(0)[None]
    arcs = speed_profile_arcs(torch.tensor([speed]), torch.tensor(ACCELERATIONS), 6)
    return along_path(path, 2.5, arcs)[0]


def box(x: float, y: float = 0.0, vx: float = 0.0, vy: float = 0.0, yaw: float = 0.0) -> torch.Tensor:
    return torch.tensor([[x, y, 0.8, *CAR, yaw, vx, vy]])


PREFERS_HOLDING_SPEED = torch.tensor([-5.0, -3.0, -1.0, 0.0, -0.5])


def test_a_stopped_car_ahead_rules_out_the_candidates_that_could_not_stop_before_it():
    """8 m/s, a car standing 30 m ahead (rear bumper 27.75 m on): holding speed ends the horizon at 24 m with the
    bumper 0.15 m short, but needs 9 m more to stop at 3.5 m/s^2; -1 m/s^2 ends at 5 m/s and stops 1 m short."""
    trajectories = candidates(8.0)
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, torch.zeros(0, 9), 3.5) == 3  # nothing detected
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(30.0), 3.5) == 2
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(30.0, vx=8.0), 3.5) == 3  # a lead car: drive on
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(30.0, y=4.0), 3.5) == 3  # beside the path


def test_it_reads_the_path_the_candidates_share_and_what_crosses_it():
    """On a bending path the car standing on the straight line is not in the way; a pedestrian walking into the
    path is, where the candidate will be when they get there."""
    bent = candidates(8.0, bend=0.06)
    assert guarded_choice(bent, PREFERS_HOLDING_SPEED, box(30.0), 3.5) == 3
    straight = candidates(8.0)
    walker = torch.tensor([[20.0, -6.0, 0.9, 0.6, 0.6, 1.8, math.pi / 2, 0.0, 2.0]])  # on the path in 3 s
    hits = colliding_candidates(straight, walker, 3.5)
    assert hits[3] and not hits[0]  # holding speed meets them at 20 m; the hardest braking stops at 4.6 m
    walker[0, 8] = 0.0  # standing on the kerb 6 m to the side
    assert not colliding_candidates(straight, walker, 3.5).any()


def test_what_comes_from_behind_is_not_braked_for_and_with_no_way_out_it_brakes_hardest():
    trajectories = candidates(8.0)
    behind = box(-6.0, vx=14.0)  # a faster car closing from behind
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, behind, 3.5) == 3
    assert guarded_choice(trajectories, PREFERS_HOLDING_SPEED, box(6.0), 3.5) == 0  # every candidate hits it


def _outputs(pipeline, peak_logit: float):
    """Network outputs with one car detected 30 m ahead (score sigmoid(peak_logit)) and candidates at 8 m/s."""
    bev = pipeline.model.bev
    cells = [round((r[1] - r[0]) / bev.cell_size) for r in (bev.x_range, bev.y_range)]
    heatmap = np.full((1, len(pipeline.model.detection_classes), *cells), -10.0, np.float32)
    regression = np.zeros((1, 10, *cells), np.float32)
    cx, cy = int((30.0 - bev.x_range[0]) / bev.cell_size), int((0.0 - bev.y_range[0]) / bev.cell_size)
    heatmap[0, 0, cx, cy] = peak_logit
    regression[0, 3:6, cx, cy] = np.log(CAR)
    regression[0, 7, cx, cy] = 1.0  # cos(yaw)
    return {"plan_trajectories": candidates(8.0)[None].numpy(), "plan_scores": PREFERS_HOLDING_SPEED[None].numpy(),
            "heatmap": heatmap, "box_regression": regression}


@pytest.mark.parametrize("guard, peak, expected", [(0.0, 2.0, 3), (0.3, 2.0, 2), (0.3, -2.0, 3)],
                         ids=["no-guard", "detected", "below-the-guard-score"])
def test_a_network_policy_drives_the_guarded_plan_only_when_asked_and_only_for_what_it_detects(guard, peak, expected):
    from stack.models.post_processing import PlanPostProcessing

    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"],
                             [f"guard.score={guard}"])
    outputs = _outputs(pipeline, peak)
    np.testing.assert_allclose(PlanPostProcessing(pipeline).choose(outputs), outputs["plan_trajectories"][0, expected])


def test_bad_guard_settings_are_refused_with_the_key_named():
    from stack.errors import StackError

    for bad, key in ((["guard.score=1.5"], "guard.score"),
                     (["guard.deceleration=0"], "guard.deceleration"),
                     (["guard.score=0.2", "guard.restart_s=-1"], "guard.restart_s"),
                     (["guard.score=0.2", "guard.segmentation=1"], "guard.segmentation"),
                     (["guard.score=0.2", "guard.depth=-0.1"], "guard.depth"),
                     (["guard.reaction_s=-0.5"], "guard.reaction_s")):
        with pytest.raises(StackError, match=key):
            load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"], bad)


def test_a_guard_score_of_0_switches_a_presets_guard_off_with_its_rules():
    from stack.sim.drive_report import plan_guard_text

    files = ["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"]
    guarded, off = load_pipeline(files), load_pipeline(files, ["guard.score=0"])
    assert guarded.guard.score > 0 and off.guard.restart_s == guarded.guard.restart_s
    assert plan_guard_text(guarded.guard.settings()).startswith("through the plan guard")
    assert plan_guard_text(off.guard.settings()) == "the planner's best-scoring candidate (no plan guard)"
    checked = load_pipeline(files, ["guard.segmentation=0.2"])
    assert "segmentation sees no road user (probability under 0.2)" in plan_guard_text(checked.guard.settings())
    checked = load_pipeline(files, ["guard.depth=0.1"])
    assert "depth head puts no surface (probability under 0.1" in plan_guard_text(checked.guard.settings())
    checked = load_pipeline(files, ["guard.reaction_s=0.7"])
    assert ("always room to stop 2 m short of each after a 0.7-s reaction at 6 m/s^2"
            in plan_guard_text(checked.guard.settings()))


def test_a_checkpoint_drives_with_any_guard_setting_but_not_with_another_network():
    from stack.checkpoint.model_file import model_differences

    files = ["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"]
    trained = load_pipeline(files, ["model.temporal_frames=1"])
    guarded = load_pipeline(files, ["model.temporal_frames=1", "guard.score=0.3",
                                    "guard.deceleration=5", "guard.restart_s=1.5",
                                    "guard.segmentation=0.3", "guard.depth=0.1", "guard.reaction_s=1.0"])
    assert model_differences(trained, guarded) == []
    other = load_pipeline(files, ["model.temporal_frames=1", "model.planning_velocity=true"])
    assert [key for key, _, _ in model_differences(trained, other)] == ["model.planning_velocity"]


NOTHING = torch.zeros(0, 9)


def at(time_s: float, x: float = 0.0, y: float = 0.0, yaw: float = 0.0, speed: float = 8.0) -> Odometry:
    return Odometry(time_s, x, y, yaw, speed)


def seen(guard: PlanGuard, trajectories: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor, odometry: Odometry,
         score: float = 0.3) -> int:
    """The guard's choice with every box in `boxes` detected at `score`."""
    return guard.choose(trajectories, scores, boxes, torch.full((len(boxes),), score), odometry)




FROM_STANDSTILL_STAYS = torch.tensor([-3.0, -2.0, -1.0, 0.0, -0.5])
"""From standstill only the 1.5 m/s^2 candidate (index 4) moves; the planner prefers standing (index 3)."""


def test_after_standing_restart_s_the_best_candidate_that_moves_on_drives_if_nothing_is_in_its_way():
    guard, standing = PlanGuard(0.2, 3.5, restart_s=1.0), candidates(0.0)
    choices = [seen(guard, standing, FROM_STANDSTILL_STAYS, NOTHING, at(t, speed=0.0)) for t in (0.0, 0.5, 1.0)]
    assert choices == [3, 3, 4]
    assert seen(guard, standing, FROM_STANDSTILL_STAYS, box(6.0), at(1.5, speed=0.0)) == 3  # a car 6 m ahead
    seen(guard, candidates(3.0), FROM_STANDSTILL_STAYS, NOTHING, at(2.0, speed=3.0))  # moving again: timer reset
    assert seen(guard, standing, FROM_STANDSTILL_STAYS, NOTHING, at(2.5, speed=0.0)) == 3
    assert seen(PlanGuard(0.2, 3.5), standing, FROM_STANDSTILL_STAYS, NOTHING, at(9.0, speed=0.0)) == 3  # rule off


def test_braking_after_reaction_follows_the_candidate_for_the_reaction_time_then_stops_at_the_emergency_rate():
    arcs = candidate_arcs(candidates(10.0))  # holding speed (index 3) covers 5 m per 0.5 s
    distance, counted = braking_after_reaction(arcs, 0.6)
    assert distance[3, 5].item() == pytest.approx(6.0)  # 0.6 s at 10 m/s
    assert distance[3, -1].item() == pytest.approx(6.0 + 10.0 ** 2 / (2 * GUARD_EMERGENCY_DECELERATION))
    assert bool((distance.diff(dim=1) >= -1e-6).all())  # braking never drives backwards
    assert counted[3, :6].all() and not counted[3, -1]  # every instant it follows; none once it stands


def test_room_to_stop_does_not_trust_a_detection_driving_away_but_follows_a_lead_car_at_a_distance():
    """8 m/s: a car 14 m ahead detected driving away at 2 m/s (a standing car's typical velocity error) is braked
    for at -3 m/s^2 by the guard alone, which trusts that velocity, and hardest once the car must keep room to stop
    short of where it stands; a lead car at the ego's speed 20 m ahead is followed either way."""
    trajectories, room = candidates(8.0), PlanGuard(0.2, 3.5, reaction_s=0.6)
    assert seen(PlanGuard(0.2, 3.5), trajectories, PREFERS_HOLDING_SPEED, box(14.0, vx=2.0), at(0.0)) == 1
    assert seen(room, trajectories, PREFERS_HOLDING_SPEED, box(14.0, vx=2.0), at(0.0)) == 0
    assert seen(room, trajectories, PREFERS_HOLDING_SPEED, box(20.0, vx=8.0), at(0.5)) == 3


def test_a_network_policy_carries_its_guard_across_replans_and_a_new_drive_forgets_the_last_one():
    """Standing, with a car detected 30 m ahead: the planner prefers to stay; after guard.restart_s standing the
    guard moves on (the way is clear), and a drive that starts again (time back at 0) waits again."""
    from stack.models.post_processing import PlanPostProcessing

    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"],
                             ["guard.score=0.2", "guard.restart_s=1.0"])
    post, outputs = PlanPostProcessing(pipeline), _outputs(pipeline, 2.0)
    outputs.update(plan_trajectories=candidates(0.0)[None].numpy(), plan_scores=FROM_STANDSTILL_STAYS[None].numpy())
    plans = [post.choose(outputs, at(t, speed=0.0)) for t in (0.0, 0.5, 1.0, 0.0)]
    for plan, expected in zip(plans, (3, 3, 4, 3)):
        np.testing.assert_allclose(plan, outputs["plan_trajectories"][0, expected])


TINY_DRIVE = ["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"]


def _rig(pipeline):
    """(K (N, 3, 3), camera_to_ego (N, 4, 4), (height, width), segmentation cells (h, w)) of the preset's rig."""
    from stack.rig import rig_matrices

    rig, stride = pipeline.data.rig, pipeline.model.segmentation_stride
    ks, poses = (torch.from_numpy(m) for m in rig_matrices(rig))
    return ks, poses, (rig.image_height, rig.image_width), (rig.image_height // stride, rig.image_width // stride)


def _cell(point, k, pose, cells, size):
    """The segmentation cell (row, column) an ego-frame point projects to in one camera."""
    in_camera = torch.linalg.inv(pose.float()) @ torch.tensor([*point, 1.0])
    u, v, w = (k.float() @ in_camera[:3]).tolist()
    return int(v / w * cells[0] / size[0]), int(u / w * cells[1] / size[1])


def test_segmentation_support_is_the_road_user_probability_where_the_box_lies_in_the_images():
    pipeline = load_pipeline(TINY_DRIVE)
    ks, poses, size, cells = _rig(pipeline)
    front = int(torch.argmax(poses[:, 0, 2]))  # the camera whose optical axis points most along +x
    car, elsewhere = box(15.0), box(15.0, y=-8.0)
    things = torch.zeros(len(ks), *cells)
    assert segmentation_support(torch.cat([car, elsewhere]), things, ks, poses, size).tolist() == [0.0, 0.0]
    things[(front, *_cell((15.0, 0.0, 0.8), ks[front], poses[front], cells, size))] = 0.9
    support = segmentation_support(torch.cat([car, elsewhere]), things, ks, poses, size)
    assert support[0] == pytest.approx(0.9) and support[1] == 0.0  # the other box's image holds no road user
    behind = box(-15.0)  # seen by no camera of the front one alone: nothing to check it against
    assert segmentation_support(behind, things[front:front + 1], ks[front:front + 1], poses[front:front + 1],
                                size).tolist() == [1.0]


def test_depth_support_is_the_depth_heads_mass_between_the_boxs_near_face_and_its_centre():
    """A box 15 m ahead: the depth head putting its surface at 14 m supports it; putting it at 25 m (a road user
    behind, the box a smear in front of it) does not; a box no camera sees keeps full support."""
    pipeline = load_pipeline(TINY_DRIVE)
    ks, poses, size, _ = _rig(pipeline)
    depth, stride = pipeline.model.depth, pipeline.model.feature_stride
    cells = (size[0] // stride, size[1] // stride)
    front = int(torch.argmax(poses[:, 0, 2]))
    width = (depth.max_m - depth.min_m) / depth.bins

    def probabilities(at_m):
        probs = torch.zeros(len(ks), depth.bins, *cells)
        probs[:, int((at_m - depth.min_m) / width)] = 1.0  # every cell of every camera sees a surface at at_m
        return probs

    edges = (depth.min_m, depth.max_m)
    car = box(15.0)  # 4.5 m long: its near face 12.75 m ahead, the camera a little ahead of the rear axle
    assert depth_support(car, probabilities(14.0), edges, ks, poses, size).tolist() == [1.0]
    assert depth_support(car, probabilities(25.0), edges, ks, poses, size).tolist() == [0.0]
    behind = box(-15.0)
    assert depth_support(behind, probabilities(25.0)[front:front + 1], edges, ks[front:front + 1],
                         poses[front:front + 1], size).tolist() == [1.0]
    assert depth_support(car[:0], probabilities(14.0), edges, ks, poses, size).shape == (0,)


@pytest.mark.parametrize("road_user_logit, expected", [(8.0, 2), (-8.0, 3)], ids=["seen", "not-seen"])
def test_with_plan_guard_segmentation_a_detection_the_segmentation_does_not_see_is_not_braked_for(road_user_logit,
                                                                                                  expected):
    from stack.models.post_processing import PlanPostProcessing

    pipeline = load_pipeline(TINY_DRIVE, ["guard.score=0.3", "guard.segmentation=0.2"])
    _, _, _, cells = _rig(pipeline)
    classes = pipeline.model.segmentation_classes
    logits = np.zeros((1, len(pipeline.data.rig.cameras), len(classes), *cells), np.float32)
    logits[:, :, classes.index("road")] = 4.0
    logits[:, :, classes.index("car")] = road_user_logit
    outputs = {**_outputs(pipeline, 2.0), "seg_logits": logits}
    np.testing.assert_allclose(PlanPostProcessing(pipeline).choose(outputs), outputs["plan_trajectories"][0, expected])


@pytest.mark.parametrize("surface_m, expected", [(29.0, 2), (45.0, 3)], ids=["depth-agrees", "surface-behind-it"])
def test_with_plan_guard_depth_a_detection_in_front_of_the_surface_the_depth_head_sees_is_not_braked_for(surface_m,
                                                                                                         expected):
    """The car detected 30 m ahead is braked for where the depth head puts a surface at 29 m along its rays, and
    ignored where it puts every surface at 45 m (the box would be a smear in front of something farther)."""
    from stack.models.post_processing import PlanPostProcessing

    pipeline = load_pipeline(TINY_DRIVE, ["guard.score=0.3", "guard.depth=0.1"])
    depth, stride, rig = pipeline.model.depth, pipeline.model.feature_stride, pipeline.data.rig
    logits = np.zeros((1, len(rig.cameras), depth.bins, rig.image_height // stride, rig.image_width // stride),
                      np.float32)
    logits[:, :, int((surface_m - depth.min_m) / ((depth.max_m - depth.min_m) / depth.bins))] = 20.0
    outputs = {**_outputs(pipeline, 2.0), "depth_logits": logits}
    np.testing.assert_allclose(PlanPostProcessing(pipeline).choose(outputs), outputs["plan_trajectories"][0, expected])


def test_plan_guard_depth_on_a_model_without_the_depth_output_says_what_to_do():
    from stack.models.post_processing import PlanPostProcessing
    from stack.errors import StackError

    pipeline = load_pipeline(TINY_DRIVE, ["guard.score=0.3", "guard.depth=0.1"])
    with pytest.raises(StackError, match="guard.depth=0"):
        PlanPostProcessing(pipeline).choose(_outputs(pipeline, 2.0))


def test_plan_guard_segmentation_on_a_model_without_the_segmentation_output_says_what_to_do():
    from stack.models.post_processing import PlanPostProcessing
    from stack.errors import StackError

    pipeline = load_pipeline(TINY_DRIVE, ["guard.score=0.3", "guard.segmentation=0.2"])
    with pytest.raises(StackError, match="guard.segmentation=0"):
        PlanPostProcessing(pipeline).choose(_outputs(pipeline, 2.0))
