"""Closed-loop states labelled by the expert (stack.sim.recording): training episodes never share a world
with an evaluation episode, a noisy expert leaves the expert's path while its labels lead back, and DAgger's
mixture drives as its beta says."""

import json
import math

import numpy as np
import pytest

from stack.config import load_pipeline
from stack.sim.policies import Policy, PolicySpec, build_policy
from stack.sim.recording import MixturePolicy, NoisyExpertPolicy, past_positions, record_episode, training_specs
from stack.sim.scenarios import FAMILIES, EpisodeSpec, build_world, episode_specs, rng_words
from tests.sim.test_drive import micro_pipeline


@pytest.fixture(scope="module")
def pipeline():
    return micro_pipeline()


def noisy_expert(pipeline):
    return NoisyExpertPolicy(PolicySpec("noisy expert", "noisy_expert", builder=NoisyExpertPolicy),
                             pipeline.model.planning_steps, pipeline)


def test_training_episodes_never_share_a_world_with_evaluation_episodes_or_recorded_scenes():
    """Whatever the counts and seeds asked for, the generator's seed words of a training episode differ from
    every evaluation episode's and every recorded scene's ([seed, scene] and [seed, scene, 1]); the tuning
    episodes (`drive.split: tuning`) are a third set, apart from both."""
    world = load_pipeline([], []).data.world
    train = {tuple(rng_words(s, world)) for s in training_specs(FAMILIES, 700, 8.0)}
    held_out = {tuple(rng_words(s, world)) for s in episode_specs(FAMILIES, 700, range(20), 8.0)}
    tuning = {tuple(rng_words(s, world)) for s in episode_specs(FAMILIES, 700, range(20), 8.0, "tuning")}
    assert len(train) == 700 and not train & held_out
    assert len(tuning) == 700 and not tuning & held_out and not tuning & train
    assert all(len(words) == 5 for words in train | held_out | tuning)
    assert not any(spec.held_out for spec in training_specs(FAMILIES, 14, 8.0))
    first, other = training_specs(["lead_brake"], 1, 8.0)[0], EpisodeSpec("lead_brake", 0, 0, 8.0)
    assert not np.allclose(build_world(first, world).ego_state(), build_world(other, world).ego_state()), \
        "the same family, index and seed as training and as evaluation must be different worlds"


def test_expert_driven_frames_are_labelled_with_the_plan_it_drove(pipeline):
    expert = build_policy(PolicySpec("expert", "expert"), pipeline)
    spec = training_specs(["lead_brake"], 1, 6.0)[0]
    frames, run = record_episode(spec, expert, pipeline)
    assert run.end is None and len(frames) == run.replans == 12
    rig = pipeline.data.rig
    for frame in frames:
        assert frame["images"].shape == (len(rig.cameras), rig.image_height, rig.image_width, 3)
        assert frame["depth"].shape == frame["semantic"].shape == frame["images"].shape[:3]
        assert frame["boxes"].shape[1] == 10 and len(frame["boxes"]) == len(frame["box_ids"])
        assert frame["future"].shape == (pipeline.model.planning_steps, 2)
        assert frame["past"].shape == (4, 2) and np.all(np.diff(frame["past"][:, 0]) > 0), "oldest first, behind"
        assert frame["ego"][0] > 1.0 and int(frame["command"][0]) in (0, 1, 2)
    # the lead car brakes 1-3 s in: the labels slow down (the 3-s reach shrinks)
    reach = [float(np.hypot(*f["future"][-1])) for f in frames]
    assert min(reach) < reach[0] - 3.0, reach


def test_the_noisy_expert_leaves_the_path_and_its_labels_lead_back(pipeline):
    """DART's point: the recorded states are off the expert's path, and every label is the expert's recovery."""
    driver = noisy_expert(pipeline)
    offsets, recovers = [], []
    for spec in training_specs(["route", "stopped_vehicle", "cut_in"], 6, 6.0):
        world = build_world(spec, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
        frames, _ = record_episode(spec, driver, pipeline)
        for frame in frames:
            lateral = float(frame["future"][1, 1])  # the label's lateral position 1 s ahead, ego frame
            offsets.append(abs(lateral))
            recovers.append(abs(lateral) > 0.3)
        del world
    assert max(offsets) > 0.5, "the noise must carry the ego off the route's centreline"
    assert sum(recovers) >= 3, "labels off a drifted state must steer back toward the route"
    again, _ = record_episode(training_specs(["route"], 1, 6.0)[0], noisy_expert(pipeline), pipeline)
    first, _ = record_episode(training_specs(["route"], 1, 6.0)[0], driver, pipeline)
    assert all(np.array_equal(a["future"], b["future"]) for a, b in zip(first, again)), "noise replays per episode"


def test_a_hygienic_expert_reacts_only_to_road_users_the_cameras_have_shown(pipeline):
    """LEAD's expert hygiene: under data.world.expert_sees=cameras the teacher does not brake for the jaywalker
    while the parked car hides them (the privileged teacher does, 0.5-1 s before a camera shows them), and once
    a camera has shown them both teachers plan alike, also while they are hidden again (remembered)."""
    from stack.sim.episode import run_episode
    from stack.sim.recording import LabelledFrames

    hidden_gaps, after = [], []
    for spec in training_specs(["jaywalker"], 4, 6.0)[2:]:  # both have the parked car that hides the pedestrian
        world = build_world(spec, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
        labeller = LabelledFrames(pipeline.data.rig, pipeline.model.planning_steps, cameras_only=True)

        def observe(w, status):
            labeller(w, status)
            privileged = float(np.hypot(*w.expert_plan(pipeline.model.planning_steps, 0.5)[-1]))
            hygienic = float(np.hypot(*labeller.frames[-1]["future"][-1]))
            (after if 1 in w.camera_sight else hidden_gaps).append(hygienic - privileged)
            seen = set(labeller.frames[-1]["box_ids"][labeller.frames[-1]["visibility"] > 0, 1].tolist())
            assert seen <= w.camera_sight

        run_episode(world, build_policy(PolicySpec("expert", "expert"), pipeline), pipeline.drive,
                    pipeline.data.rig, observer=observe)
    assert max(hidden_gaps) > 10.0, "the privileged teacher brakes for the hidden pedestrian; the hygienic one does not"
    assert min(hidden_gaps) > -1e-6, "seeing fewer road users never brakes harder here"
    assert after and max(abs(gap) for gap in after) < 1e-6, "once seen, the same plan"
    with pytest.raises(Exception, match="expert_sees"):
        micro_pipeline("data.world.expert_sees=lidar")


def test_the_noisy_expert_follows_the_hygienic_teacher_when_asked(pipeline):
    """The driver of the recorded episodes uses the same sight as the labels (its states are the teacher's)."""
    spec = training_specs(["jaywalker"], 4, 6.0)[3]
    cameras = micro_pipeline("data.world.expert_sees=cameras")
    privileged, _ = record_episode(spec, noisy_expert(pipeline), pipeline)
    hygienic, _ = record_episode(spec, noisy_expert(cameras), cameras)
    speed = [float(f["ego"][0]) for f in privileged], [float(f["ego"][0]) for f in hygienic]
    assert max(b - a for a, b in zip(*speed)) > 0.5, "hygienic: no early braking for the hidden pedestrian"


class Straight(Policy):
    """Keeps its speed straight ahead (a stand-in student)."""

    def plan(self, observation):
        t = 0.5 * np.arange(1, self.steps + 1)
        return np.stack([float(observation.ego_status[0]) * t, np.zeros_like(t)], axis=1)


def test_dagger_mixture_is_the_expert_at_beta_one_and_the_student_at_zero(pipeline):
    student = Straight(PolicySpec("straight", "custom", builder=Straight), pipeline.model.planning_steps)
    spec = training_specs(["lead_brake"], 1, 4.0)[0]
    expert_frames, _ = record_episode(spec, build_policy(PolicySpec("expert", "expert"), pipeline), pipeline)
    as_expert, _ = record_episode(spec, MixturePolicy(student, 1.0), pipeline)
    as_student, run = record_episode(spec, MixturePolicy(student, 0.0), pipeline)
    alone, _ = record_episode(spec, student, pipeline)
    assert all(np.array_equal(a["future"], b["future"]) for a, b in zip(expert_frames, as_expert))
    assert all(np.array_equal(a["ego"], b["ego"]) for a, b in zip(alone, as_student))
    # the student does not brake for the braking lead; the labels of the states it reaches do
    assert as_student[-1]["ego"][0] > expert_frames[-1]["ego"][0] + 1.0
    assert float(np.hypot(*as_student[-1]["future"][-1])) < float(as_student[-1]["ego"][0]) * 3.0 - 3.0


def test_past_positions_extend_the_first_pose_backwards_before_the_episode(pipeline):
    world = build_world(training_specs(["route"], 1, 4.0)[0], pipeline.data.world, 0.1)
    past = past_positions(world)
    speed = world.ego_state()[3]
    assert np.allclose(past[:, 1], 0.0, atol=1e-6)
    assert np.allclose(past[:, 0], -speed * np.array([2.0, 1.5, 1.0, 0.5]), atol=1e-4)
    assert math.isclose(float(np.hypot(*past[-1])), speed * 0.5, rel_tol=1e-4)


def test_data_make_writes_noisy_expert_episodes_into_the_train_split(tmp_path):
    import tarfile

    from stack.data.make import make_dataset

    pipeline = micro_pipeline(f"data.root={tmp_path}", "data.world.scenes=2", "data.world.frames_per_scene=2",
                              "data.world.val_fraction=0.5", "data.world.agents_per_scene=6",
                              "data.world.drive_episodes=2", "drive.episode_seconds=2.0", "data.world.workers=1")
    manifest = make_dataset(pipeline, log=lambda *_: None)
    assert manifest["closed_loop_episodes"] == 2
    train = sum(shard["samples"] for shard in manifest["splits"]["train"])
    val = sum(shard["samples"] for shard in manifest["splits"]["val"])
    assert val == 2 and train == 2 + 2 * 4, "one scene's 2 frames + 2 episodes x 4 replanning instants"
    sources = []
    for shard in manifest["splits"]["train"]:
        with tarfile.open(tmp_path / shard["path"]) as tar:
            for name in tar.getnames():
                if name.endswith(".meta.json"):
                    sources.append(json.loads(tar.extractfile(name).read()).get("source", "recorded"))
    assert sources.count("closed_loop") == 8 and sources.count("recorded") == 2
    with pytest.raises(Exception, match="drive_episodes"):
        micro_pipeline("data.layout=clips", "data.world.drive_episodes=2")
