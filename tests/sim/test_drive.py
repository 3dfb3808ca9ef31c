"""The closed loop end to end: episodes replay exactly, the expert drives clean, blind policies crash where
the cameras matter, latency delays the reaction, the checkpoint and its fp32 ONNX drive alike, and bad
input to `stack drive` is refused with exit 2.

Network policies use a micro BevNet (128x64 images) with untrained weights: what these tests check
(determinism, equality of the two runtimes, the plumbing) does not depend on training.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from stack.cli import main
from stack.config import load_pipeline
from stack.deploy.network_policies import bundle_spec, checkpoint_spec
from stack.sim.episode import run_episode
from stack.sim.policies import PolicySpec, build_policy
from stack.sim.scenarios import EpisodeSpec, build_world
from stack.metrics.driving import score_episode

REPO = Path(__file__).resolve().parents[2]
FILES = [str(REPO / "configs/pipeline.yaml"), str(REPO / "configs/presets/tiny.yaml")]
MICRO = ["data.rig.image_width=128", "data.rig.image_height=64", "model.bev.x_range=[-16.0,16.0]",
         "model.bev.y_range=[-16.0,16.0]", "model.depth.bins=16", "model.neck_channels=16", "model.bev_channels=16",
         "drive.episode_seconds=6.0", "drive.workers=1", "drive.clips=0",
         # no dataset: a checkpoint records the cameras of the one at data.root (its lineage), and the tiny
         # preset's runs/tiny/data, which `make demo` and the recipe render, has other cameras than this rig
         f"data.root={REPO / 'runs' / 'test-drive-has-no-dataset'}"]
PERCEPTION_FAMILIES = ("lead_brake", "stopped_vehicle", "zebra_crossing", "jaywalker")


def micro_pipeline(*extra):
    return load_pipeline(FILES, [*MICRO, *extra])


@pytest.fixture(scope="module")
def pipeline():
    return micro_pipeline()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, pipeline):
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.models import build_model

    torch.manual_seed(0)
    return save_model_checkpoint(tmp_path_factory.mktemp("drive") / "model.pt", pipeline,
                                 build_model(pipeline).state_dict())


def drive_once(pipeline, spec: PolicySpec, episode: EpisodeSpec):
    world = build_world(episode, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
    return run_episode(world, build_policy(spec, pipeline), pipeline.drive, pipeline.data.rig)


def episode(family: str, index: int = 0, seed: int = 0, seconds: float = 6.0) -> EpisodeSpec:
    return EpisodeSpec(family, index, seed, seconds)


def expert_progress(pipeline, spec: EpisodeSpec) -> float:
    return float(np.max(drive_once(pipeline, PolicySpec("expert", "expert"), spec).trace.progress))


def test_the_same_policy_and_seed_replay_the_same_episode(pipeline):
    spec = episode("route", 3, 1)
    first = drive_once(pipeline, PolicySpec("expert", "expert"), spec).trace
    second = drive_once(pipeline, PolicySpec("expert", "expert"), spec).trace
    assert np.array_equal(first.ego, second.ego) and np.array_equal(first.agents, second.agents)
    other = drive_once(pipeline, PolicySpec("expert", "expert"), episode("route", 3, 2)).trace
    assert not np.array_equal(first.ego, other.ego), "another seed must give another episode"


@pytest.mark.parametrize("family", ["route", "lead_brake", "stopped_vehicle", "zebra_crossing", "jaywalker",
                                    "unprotected_turn", "cut_in"])
def test_the_expert_completes_its_routes_without_collisions(pipeline, family):
    for index in range(3):
        spec = episode(family, index, index % 3)
        trace = drive_once(pipeline, PolicySpec("expert", "expert"), spec).trace
        score = score_episode(trace, float(np.max(trace.progress)))
        assert score["collisions"] == 0, f"{family} #{index}: the expert collided ({score})"
        assert score["drivable_area_compliance"] == 1.0, f"{family} #{index}: the expert left the road"
        assert score["route_completion"] > 0.6, f"{family} #{index}: the expert stalled ({score['route_completion']:.2f})"


def test_the_simulation_rate_is_configurable():
    pipeline = micro_pipeline("drive.sim_hz=20", "drive.replan_hz=4")
    trace = drive_once(pipeline, PolicySpec("expert", "expert"), episode("lead_brake", 2, 1)).trace
    assert trace.dt == 0.05 and len(trace.ego) == 121
    score = score_episode(trace, float(np.max(trace.progress)))
    assert score["collisions"] == 0 and score["route_completion"] > 0.6, score


@pytest.mark.parametrize("blind", ["constant_velocity", "ego_rollout"])
def test_blind_policies_fail_where_the_scenario_needs_the_cameras(pipeline, blind):
    """Blind to the cameras, a policy runs into what it cannot see (or, rolling out a bend's yaw rate, off the
    road): the expert, seeing everything, does neither."""
    failed, collided, expert_scores, blind_scores = 0, 0, [], []
    for family in PERCEPTION_FAMILIES:
        for index in range(2):
            spec = episode(family, index, index)
            reference = expert_progress(pipeline, spec)
            expert_scores.append(score_episode(drive_once(pipeline, PolicySpec("expert", "expert"), spec).trace,
                                               reference)["pdms"])
            score = score_episode(drive_once(pipeline, PolicySpec(blind, blind), spec).trace, reference)
            blind_scores.append(score["pdms"])
            collided += score["collisions"] > 0
            failed += score["collisions"] > 0 or score["drivable_area_compliance"] < 1
    assert failed >= 6 and collided >= 4, f"{blind}: {failed} of 8 perception episodes failed, {collided} by collision"
    assert np.mean(blind_scores) < np.mean(expert_scores) - 0.3, (blind_scores, expert_scores)


def _first_brake_time(trace, threshold: float = -0.5) -> float:
    braking = np.flatnonzero(trace.ego[:, 4] < threshold)
    return float(braking[0] * trace.dt) if len(braking) else float("inf")


def test_latency_delays_the_reaction_on_the_braking_scenario():
    """Replanning every sim step (10 Hz), a policy whose plans arrive 1 s late starts braking 1 s later."""
    pipeline = micro_pipeline("drive.replan_hz=10")
    spec = episode("lead_brake", 0, 0)
    prompt = drive_once(pipeline, PolicySpec("expert", "expert"), spec).trace
    late = drive_once(pipeline, PolicySpec("expert", "expert", latency_s=1.0, latency_how="given"), spec).trace
    delay = _first_brake_time(late) - _first_brake_time(prompt)
    assert 0.8 <= delay <= 1.3, (_first_brake_time(prompt), _first_brake_time(late))
    assert late.ego[:, 4].min() < prompt.ego[:, 4].min() - 1.0, "reacting late must take harder braking"
    world = build_world(spec, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
    lead = list(world.agents_now()["track_ids"]).index(world.scripts[0].agent)  # the car that brakes
    gap = lambda t: np.min(np.linalg.norm(t.agents[:, lead, :2] - t.ego[:, :2], axis=1))  # noqa: E731
    assert gap(late) < gap(prompt) - 1.0, "a policy that reacts 1 s later must come closer to the braking car"


@pytest.fixture(scope="module")
def onnx_path(pipeline, checkpoint, tmp_path_factory):
    """The checkpoint's network exported to fp32 ONNX with the rig's calibration, as a bundle ships it."""
    from stack.checkpoint.model_file import load_model_checkpoint
    from stack.deploy.calibration import Calibration
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network

    _, state_dict, _ = load_model_checkpoint(checkpoint)
    network = export_network(pipeline, state_dict, Calibration.from_rig(pipeline.data.rig))
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    return path


def test_the_checkpoint_and_its_fp32_onnx_drive_the_same_episode(pipeline, checkpoint, onnx_path):
    spec = episode("lead_brake", 1, 0)
    torch_run = drive_once(pipeline, checkpoint_spec("checkpoint", str(checkpoint)), spec).trace
    onnx_run = drive_once(pipeline, bundle_spec("fp32", "", str(onnx_path)), spec).trace
    reference = expert_progress(pipeline, spec)
    a, b = score_episode(torch_run, reference), score_episode(onnx_run, reference)
    assert a["collisions"] == b["collisions"] and abs(a["driving_score"] - b["driving_score"]) < 0.02
    assert np.max(np.linalg.norm(torch_run.ego[:, :2] - onnx_run.ego[:, :2], axis=1)) < 0.05, \
        "ONNX Runtime and PyTorch trajectories must agree within 5 cm over the episode"


def test_stack_drive_runs_a_checkpoint_beside_the_baselines_and_an_untrained_one_fails_the_bar(checkpoint, tmp_path,
                                                                                               capsys):
    """The checkpoint is untrained: its planner is the ego-status rollout it starts from, so it cannot beat that
    blind policy: `stack drive` reports the bar as FAIL and exits 1, as `stack eval` does for a head below its bar."""
    out = tmp_path / "drive"
    code = main(["drive", str(checkpoint), "--episodes", "3", "--scenarios", "lead_brake,route",
                 f"drive.out_dir={out}", "drive.seeds=[0]", "drive.latency_ms=0", "drive.episode_seconds=4.0"])
    assert code == 1 and "below the closed-loop bar" in capsys.readouterr().out
    report = (out / "drive.md").read_text()
    assert "## The bar: `checkpoint` FAIL" in report and "`ego_rollout` | pdms" in report
    assert "`checkpoint` drives the planner's best-scoring candidate (no plan guard)" in report
    assert "checkpoint alone" not in report  # with no guard there is nothing to set it apart from
    for policy in ("checkpoint", "expert", "constant_velocity", "ego_rollout"):
        assert policy in report
    assert (out / "drive.json").is_file() and (out / "drive.png").stat().st_size > 1000


def test_tuning_episodes_are_driven_on_request_and_reported_as_not_held_out(checkpoint, tmp_path):
    """drive.split=tuning: the worlds for choosing settings (guard.score) without looking at the evaluation
    episodes; the report says they are not the held-out set, how the network's plan was guarded, and drives the
    network alone beside it (information: which part drives)."""
    import json

    out = tmp_path / "tune"
    code = main(["drive", str(checkpoint), "--episodes", "1", "--scenarios", "route", f"drive.out_dir={out}",
                 "drive.seeds=[0]", "drive.latency_ms=0", "drive.episode_seconds=2.0", "drive.split=tuning",
                 "drive.baselines=[expert]", "guard.score=0.2", "guard.restart_s=0.5"])
    assert code in (0, 1)
    meta = json.loads((out / "drive.json").read_text())["meta"]
    assert meta["split"] == "tuning" and meta["post_processing"]["checkpoint"]["restart_s"] == 0.5
    assert meta["post_processing"]["checkpoint alone"]["score"] == 0.0
    assert meta["alone_of"] == {"checkpoint alone": "checkpoint"} and meta["bar"]["checkpoint alone"]["information"]
    report = (out / "drive.md").read_text()
    assert "1 tuning (not held-out" in report
    assert "through the plan guard (detections scoring >= 0.2;" in report and "after 0.5 s standing" in report
    assert "`checkpoint alone` drives the planner's best-scoring candidate (no plan guard) (the network alone" in report


def test_clips_show_each_policy_worst_episodes_and_its_best_of_every_family():
    """drive.clips picks a policy's lowest driving scores over all episodes; drive.best_clips its highest in each
    family (ties broken by PDMS): a family whose hazard it handles shows up as a best clip even when the policy's
    worst episodes all come from another family."""
    from stack.sim.drive import best_episodes, worst_episodes

    def row(policy, family, index, score, pdms):
        return {"policy": policy, "family": family, "index": index, "seed": 0,
                "metrics": {"driving_score": score, "pdms": pdms}}

    rows = [row("net", "route", 0, 0.2, 0.1), row("net", "route", 1, 0.3, 0.0), row("net", "stopped_vehicle", 2, 0.9, 0.5),
            row("net", "stopped_vehicle", 3, 0.9, 0.7), row("net", "stopped_vehicle", 4, 0.4, 0.4),
            row("expert", "route", 5, 1.0, 0.9)]
    assert [r["index"] for r in worst_episodes(rows, 2)] == [0, 1, 5]
    assert [r["index"] for r in best_episodes(rows, 1)] == [1, 3, 5]
    assert [r["index"] for r in best_episodes(rows, 2)] == [1, 0, 3, 2, 5]
    assert best_episodes(rows, 0) == []


def test_bad_input_exits_2_with_a_clear_message(checkpoint, tmp_path, capsys):
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.models import build_model

    assert main(["drive", str(checkpoint), "--scenarios", "highway_merge", f"drive.out_dir={tmp_path}"]) == 2
    assert "highway_merge" in capsys.readouterr().err
    pipeline = micro_pipeline()
    state = {k: v for k, v in build_model(pipeline).state_dict().items() if not k.startswith("planning_head.")}
    no_planner = save_model_checkpoint(tmp_path / "perception_only.pt", pipeline, state)
    assert main(["drive", str(no_planner), f"drive.out_dir={tmp_path}"]) == 2
    assert "no planning head" in capsys.readouterr().err
    other = micro_pipeline("data.rig.image_width=160")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "gate.json").write_text("{}")
    from stack.config import pipeline_to_yaml

    (bundle / "pipeline.yaml").write_text(pipeline_to_yaml(other))
    assert main(["drive", str(checkpoint), str(bundle), f"drive.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "another pipeline" in err and "data.rig" in err, err
    assert main(["drive", str(tmp_path / "missing.pt")]) == 2
    assert main(["bench", "drive", str(checkpoint)]) == 2
    assert "not a deploy bundle folder" in capsys.readouterr().err
    assert main(["bench", "drive", str(bundle)]) == 2  # the default pipeline's network is not the bundle's
    assert "another pipeline" in capsys.readouterr().err
    assert main(["bench", "model", str(bundle)]) == 2
    assert "deploy bundle folders are for `stack bench drive BUNDLE ...`" in capsys.readouterr().err


def test_bench_drive_reports_the_network_the_bundle_the_dagger_recording_and_the_blind_rollout(checkpoint, onnx_path,
                                                                                             capsys):
    from stack.benchrecord import FigureLog
    from stack.sim import bench

    pipeline = micro_pipeline("drive.episode_seconds=2.0")
    figures = FigureLog()
    deployed = bundle_spec("bundle fp32", "", str(onnx_path))
    assert bench.run(pipeline, checkpoint_spec("checkpoint", str(checkpoint)), "untrained weights", figures,
                     [deployed]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines() if line.startswith("| ")}
    bundle_row = "network (bundle fp32, ONNX Runtime)"
    assert {bench.NETWORK_ROW, bundle_row, bench.DAGGER_ROW, bench.BLIND_ROW} <= set(rows)
    labelling = {name: float(cells[6]) for name, cells in rows.items() if name != "policy"}
    assert labelling[bench.DAGGER_ROW] > 0 and labelling[bench.NETWORK_ROW] == 0, "only DAgger's drive labels"
    built = {name: (float(cells[7]), float(cells[8])) for name, cells in rows.items() if name != "policy"}
    assert all(world > 0 for world, _ in built.values()), "every row builds its episodes' worlds"
    assert built[bench.NETWORK_ROW][1] > 0 and built[bench.DAGGER_ROW][1] < 0.05, "a policy is built once a process"
    rendered = {name: float(cells[3]) for name, cells in rows.items() if name != "policy"}
    assert rendered[bundle_row] > 0 and rendered[bench.BLIND_ROW] < 0.05, "the blind rollout renders nothing"
    shares = re.findall(r"^(.*?): rendering .*: (\d+)% of the floor's rate \(goal: 80%\)", out, re.M)
    assert [name.strip() for name, _ in shares] == [bench.NETWORK_ROW, bundle_row]
    assert all(0 < int(share) <= 100 for _, share in shares), "a policy cannot outrun the renderer it waits for"
    recorded = {figure.name: figure for figure in figures.figures}  # what --record keeps: a sample per episode
    assert recorded[f"{bench.NETWORK_ROW}: sim-s per wall-s"].floor > 0
    assert recorded[f"{bundle_row}: sim-s per wall-s"].floor > 0
    assert recorded[f"{bench.BLIND_ROW}: sim-s per wall-s"].floor is None
    assert recorded[f"{bench.DAGGER_ROW}: sim-s per wall-s"].floor is None
    assert len(recorded[f"{bench.DAGGER_ROW}: labelling per episode"].samples) == bench.BENCH_EPISODES
    assert f"{bench.NETWORK_ROW}: labelling per episode" not in recorded


def test_a_temporal_checkpoint_carries_its_bev_memory_through_each_episode(tmp_path):
    """model.temporal_frames=1 in closed loop: the first replan of an episode has no memory (the frame is fused with
    itself), every later one gets the previous replan's BEV and the ego motion since, and a new episode starts over."""
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.deploy.network_policies import checkpoint_spec
    from stack.models import build_model

    temporal = micro_pipeline("model.temporal_frames=1")
    torch.manual_seed(0)
    path = save_model_checkpoint(tmp_path / "model.pt", temporal, build_model(temporal).state_dict())
    policy = build_policy(checkpoint_spec("temporal", str(path), latency_s=0.05, latency_how="stated"), temporal)
    calls, forward = [], policy.net.forward

    def spy(*args):
        calls.append((args[5] is not None, None if args[6] is None else args[6].clone()))
        return forward(*args)

    policy.net.forward = spy
    for spec in (episode("route", seconds=1.5), episode("lead_brake", seconds=1.5)):
        world = build_world(spec, temporal.data.world, 1.0 / temporal.drive.sim_hz)
        start = len(calls)
        run = run_episode(world, policy, temporal.drive, temporal.data.rig)
        carried = [has for has, _ in calls[start:]]
        assert run.replans == len(carried) >= 3 and carried == [False] + [True] * (len(carried) - 1)
        moved = [float(pose[0, 0]) for has, pose in calls[start + 1:]]
        assert all(-8.0 < x < -1.0 for x in moved), f"the ego was 0.5 s of driving behind: {moved}"


@pytest.mark.parametrize("frames", [1, 2])
def test_a_temporal_checkpoint_and_its_stateful_onnx_drive_the_same_episode(tmp_path, frames):
    """The exported stateful graph in closed loop: DeployedNetwork carries the BEV memory (of k = 1 or 2 key frames)
    between replans and forgets it at an episode's start, as the checkpoint policy does, so both drive the same
    trajectory."""
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.deploy.calibration import Calibration
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network
    from stack.models import build_model

    temporal = micro_pipeline(f"model.temporal_frames={frames}")
    torch.manual_seed(0)
    state_dict = build_model(temporal).state_dict()
    checkpoint = save_model_checkpoint(tmp_path / "model.pt", temporal, state_dict)
    network = export_network(temporal, state_dict, Calibration.from_rig(temporal.data.rig))
    onnx_path = tmp_path / "model.onnx"
    export_onnx(network.net, network.example, network.output_names, onnx_path, temporal.export.opset, network.metadata)
    onnx_policy = build_policy(bundle_spec("fp32", "", str(onnx_path)), temporal)
    fused = []
    infer = onnx_policy.net.infer

    def spy(*args, **kwargs):
        out = infer(*args, **kwargs)
        fused.append(onnx_policy.net.fused_memory)
        return out

    onnx_policy.net.infer = spy
    for spec in (episode("lead_brake", 1, 0, seconds=2.0), episode("route", seconds=1.5)):
        world = build_world(spec, temporal.data.world, 1.0 / temporal.drive.sim_hz)
        start = len(fused)
        onnx_run = run_episode(world, onnx_policy, temporal.drive, temporal.data.rig).trace
        assert fused[start:] == [False] + [True] * (len(fused) - start - 1) and len(fused) - start >= 3
        torch_run = drive_once(temporal, checkpoint_spec("checkpoint", str(checkpoint)), spec).trace
        assert np.max(np.linalg.norm(torch_run.ego[:, :2] - onnx_run.ego[:, :2], axis=1)) < 0.05, \
            "the stateful ONNX graph and the checkpoint must drive within 5 cm of each other"


def test_a_temporal_checkpoint_gets_in_closed_loop_what_the_loader_gives_it_in_training(tmp_path):
    """The closed loop's temporal inputs against the training loader's on one recorded episode (the frames
    `stack.sim.recording` writes and the loader reads back): key frames 0.5 s apart; the images the policy saw
    are the ones recorded (the loader's `previous_images` one frame later); the previous pose is the ego's true
    motion between the two replanning instants, and what `previous_pose` of the recorded past trajectory gives
    the loader; the memory is `BevNet.memory` of the previous instant's images (what training computes); and an
    episode's first replan, with no memory, plans as the loader's sequence start does (the frame fused with
    itself through a zero motion)."""
    import math

    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.kinematics import previous_pose
    from stack.models import build_model
    from stack.sim.recording import LabelledFrames

    temporal = micro_pipeline("model.temporal_frames=1")
    torch.manual_seed(0)
    path = save_model_checkpoint(tmp_path / "model.pt", temporal, build_model(temporal).state_dict())
    policy = build_policy(checkpoint_spec("temporal-vs-loader", str(path)), temporal)
    calls, forward = [], policy.net.forward

    def spy(*args):
        calls.append({"args": args, "out": forward(*args)})
        return calls[-1]["out"]

    policy.net.forward = spy
    recorded, rear_axle = LabelledFrames(temporal.data.rig, temporal.model.planning_steps), []

    def observer(world, status):
        rear_axle.append(world.ego_state()[:3])
        recorded(world, status)

    world = build_world(episode("lead_brake", seconds=2.5), temporal.data.world, 1.0 / temporal.drive.sim_hz)
    run = run_episode(world, policy, temporal.drive, temporal.data.rig, observer=observer)
    frames = recorded.frames
    assert run.replans == len(frames) == len(calls) >= 5
    np.testing.assert_allclose(np.diff([f["time_s"] for f in frames]), 0.5, atol=1e-9)
    for i, (frame, call) in enumerate(zip(frames, calls)):
        images, memory, pose = call["args"][0], call["args"][5], call["args"][6]
        np.testing.assert_array_equal(images[0].numpy(), frame["images"].transpose(0, 3, 1, 2))
        if i == 0:
            assert memory is None and pose is None
            continue
        np.testing.assert_array_equal(pose[0].numpy(), previous_pose(frame["past"]))
        (x0, y0, yaw0), (x1, y1, yaw1) = rear_axle[i - 1], rear_axle[i]
        c, s = math.cos(yaw1), math.sin(yaw1)
        truth = ((x0 - x1) * c + (y0 - y1) * s, -(x0 - x1) * s + (y0 - y1) * c)
        np.testing.assert_allclose(pose[0, :2].numpy(), truth, atol=1e-4)
        assert abs(float(pose[0, 2]) - (yaw0 - yaw1)) < 0.01, "heading from the chord, as the loader computes it"
        with torch.inference_mode():
            expected = policy.net.memory(calls[i - 1]["args"][0], policy.geometry)
        torch.testing.assert_close(memory, expected)
        torch.testing.assert_close(memory, calls[i - 1]["out"]["bev_memory"])
    images, ego, command, geometry = calls[0]["args"][:4]
    with torch.inference_mode():  # the loader's sequence start: previous_images = the frame, previous_pose = 0
        itself = forward(images, ego, command, geometry, None, policy.net.memory(images, geometry), torch.zeros(1, 3))
    torch.testing.assert_close(itself["plan_trajectories"], calls[0]["out"]["plan_trajectories"], atol=1e-4, rtol=1e-4)
