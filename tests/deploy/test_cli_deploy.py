"""`stack export` and `stack deploy` end to end on the tiny preset: exit codes, files, bad input."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["-c", "configs/pipeline.yaml", "-c", "configs/presets/tiny.yaml"]
FAST = ["export.calibration_samples=4", "export.accuracy_samples=2", "export.timing_runs=20",
        "export.timing_warmup=3", "export.sensitivity_samples=1", "drive.episode_seconds=3.0", "drive.workers=1"]

pytestmark = pytest.mark.slow


def stack(*args):
    return subprocess.run([sys.executable, "-m", "stack", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint of an untrained tiny network, overrides pointing at a small rendered dataset)."""
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.config import load_pipeline
    from stack.models import build_model

    folder = tmp_path_factory.mktemp("tiny")
    data = [f"data.root={folder / 'data'}", "data.world.scenes=3", "data.world.frames_per_scene=4",
            "data.world.val_fraction=0.34", "data.world.workers=1"]
    made = stack("data", "make", *TINY, *data)
    assert made.returncode == 0, made.stderr
    pipeline = load_pipeline(TINY[1::2], data)
    checkpoint = save_model_checkpoint(folder / "tiny.pt", pipeline, build_model(pipeline).state_dict())
    return checkpoint, [f"export.out_dir={folder / 'export'}", *FAST], folder


def assert_bad_input(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in: {result.stderr}"


def test_export_writes_onnx_with_parity(tiny):
    checkpoint, overrides, folder = tiny
    result = stack("export", str(checkpoint), *overrides)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "every operator native" in result.stdout
    assert result.stdout.count(" ok") == 7  # seven named outputs within tolerance (attribute logits included)
    from stack.deploy.export import read_metadata

    meta = read_metadata(folder / "export" / "model.onnx")
    assert meta["pipeline_name"] == "tiny" and meta["detection_classes"][0] == "car"
    assert set(meta["output_layout"]) == {"depth_logits", "seg_logits", "heatmap", "box_regression",
                                          "plan_trajectories", "plan_scores", "attribute_logits"}
    assert meta["input_normalisation"]["inside_graph"] is True and len(meta["rig"]["cameras"]) == 6
    import onnx

    nodes = onnx.load(str(folder / "export" / "model.onnx")).graph.node
    assert all(node.name.startswith("/net/") for node in nodes), [n.name for n in nodes if not n.name.startswith("/")]
    assert not {"Mod", "ScatterND", "ScatterElements"} & {node.op_type for node in nodes}


def test_export_refuses_a_folder_of_someone_elses_files(tiny):
    """An export.out_dir holding files `stack export` did not write: exit 2, and they are left exactly as they were
    (even the one with the name export would write)."""
    checkpoint, overrides, folder = tiny
    mine = folder / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    (mine / "pipeline.yaml").write_text("name: my own\n")
    result = stack("export", str(checkpoint), *overrides, f"export.out_dir={mine}")
    assert_bad_input(result, f"export.out_dir {mine} is not empty and holds no previous export",
                     "'notes.txt', 'pipeline.yaml'", "Choose an empty or new export.out_dir", "nothing was written")
    assert sorted(path.name for path in mine.iterdir()) == ["notes.txt", "pipeline.yaml"]
    assert (mine / "notes.txt").read_text() == "my notes\n" and (mine / "pipeline.yaml").read_text() == "name: my own\n"


def test_export_again_into_its_own_previous_output(tiny):
    """Re-exporting into the folder an export wrote replaces its files, as it always did."""
    from stack.deploy.export import read_metadata

    checkpoint, overrides, folder = tiny
    out = folder / "again"
    first = stack("export", str(checkpoint), *overrides, f"export.out_dir={out}")
    assert first.returncode == 0, first.stderr[-2000:]
    before = read_metadata(out / "model.onnx")["pipeline_hash"]
    second = stack("export", str(checkpoint), *overrides, f"export.out_dir={out}", "export.parity_atol=0.002")
    assert second.returncode == 0, second.stderr[-2000:]
    assert sorted(path.name for path in out.iterdir()) == ["calibration.yaml", "model.onnx", "pipeline.yaml"]
    assert "parity_atol: 0.002" in (out / "pipeline.yaml").read_text()
    assert read_metadata(out / "model.onnx")["pipeline_hash"] not in (before, None)


@pytest.mark.serial
def test_deploy_ci_cpu_measures_and_an_untrained_network_is_not_for_deployment(tiny):
    """An untrained network passes every INT8-against-fp32 gate and the FPS gate, and is still below the quality
    bar: with --allow-below-bar the bundle is built (exit 0), marked NOT FOR DEPLOYMENT, and the runtime refuses it."""
    checkpoint, overrides, folder = tiny
    result = stack("deploy", "--target", "ci-cpu", "--allow-below-bar", str(checkpoint), *overrides, *GUARD,
                   "targets.ci-cpu.closed_loop.episodes=2", "export.timing_runs=100")  # 5 rounds of 20: a verdict
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "ci-cpu: PASS, NOT FOR DEPLOYMENT (below the quality bar)" in result.stdout
    bundle = folder / "export" / "ci-cpu"
    gate = json.loads((bundle / "gate.json").read_text())
    closed_loop = gate["closed_loop"]  # INT8 and fp32 drove the same two episodes (an untrained planner: alike)
    assert closed_loop["episodes"] == 2 and closed_loop["passed"] and closed_loop["int8"]["episodes"] == 2, closed_loop
    assert closed_loop["ego_rollout"]["episodes"] == 2 and closed_loop["constant_velocity"]["episodes"] == 2
    assert "Closed loop: INT8 against fp32" in (bundle / "report.md").read_text()
    check_post_processing_ships(bundle, gate, folder)
    assert gate["passed"] and not gate["for_deployment"] and gate["fps"]["mode"] == "measured"
    assert any(r.startswith("quality: detection mAP ") and "does not clear its bar" in r for r in gate["below_bar"])
    assert [row["head"] for row in gate["quality"]["heads"]["rows"]] == ["planning", "depth", "segmentation",
                                                                         "detection", "nuscenes"]
    verified = stack("deploy", "--verify", str(bundle))
    assert verified.returncode == 1 and "NOT FOR DEPLOYMENT" in verified.stdout, verified.stdout
    from stack.deploy.runner import DeployedNetwork, NotForDeployment

    with pytest.raises(NotForDeployment, match="below the quality bar"):
        DeployedNetwork.open(bundle)
    assert DeployedNetwork.open(bundle, allow_below_bar=True).output_names
    assert [h["head"] for h in gate["accuracy"]["heads"]] == ["detection", "segmentation", "depth", "planning"]
    assert {"detection/NDS", "detection/mAAE"} <= set(gate["accuracy"]["fp32_metrics"]) & \
        set(gate["accuracy"]["quantized_metrics"])  # information beside the gated mAP, in the report too
    assert "- INT8: NDS " in (bundle / "report.md").read_text()
    ids = gate["accuracy"]["samples"]  # calibrated on training frames, ranked on others, scored on validation
    assert len(ids["calibration"]) == 4 and len(ids["sensitivity"]) == 1 and len(ids["accuracy"]) == 2, ids
    assert all(i.startswith("train/") for i in ids["calibration"] + ids["sensitivity"])
    assert all(i.startswith("val/") for i in ids["accuracy"])
    assert not set(ids["calibration"]) & set(ids["sensitivity"])
    assert gate["shipped"]["file"] in {"model.onnx", "model.int8.onnx"} and gate["shipped"]["why"]
    assert gate["fps"]["budget_ms"] > 0 and "headroom" in (bundle / "report.md").read_text()
    assert {"model.onnx", "model.int8.onnx", "pipeline.yaml", "report.md", "latency.png"} <= {p.name for p in bundle.iterdir()}
    # the bundle drives: its shipped model on ONNX Runtime at the latency measured here, beside a blind baseline
    drove = stack("drive", str(bundle), "--policy", "network,alone,constant_velocity", "--episodes", "2",
                  f"drive.out_dir={folder / 'drive'}", "drive.seeds=[0]", "drive.episode_seconds=3.0", "drive.clips=1",
                  "drive.best_clips=1")
    assert drove.returncode in (0, 1), drove.stderr[-3000:]  # 1: the (untrained) network is below the bar
    report = (folder / "drive" / "drive.md").read_text()
    assert ("below the closed-loop bar" in drove.stdout) == (drove.returncode == 1) and "## The bar" in report
    assert "bundle ci-cpu" in report and "measured on this host" in report and "constant_velocity" in report
    clips = {p.name for p in (folder / "drive" / "clips").glob("*.mp4")}
    worst = {name for name in clips if "-best-" not in name}
    assert len(worst) == 4, clips  # the worst episode of each policy (the bundle, the same network alone) + the expert
    # and the best of each family (2 episodes: route and lead_brake) for each of the four, named apart
    assert len(clips - worst) == 8 and {name.replace("-best-", "-") for name in clips - worst} >= worst, clips
    best = report.split("## Best episode of each family")[1].split("##")[0]
    assert sum(line.startswith("| ") and ".mp4" in line for line in best.splitlines()) == 8
    assert "`bundle ci-cpu` drives through the plan guard (detections scoring >= 0.2" in report
    assert "`bundle ci-cpu alone` drives the planner's best-scoring candidate" in report


GUARD = ["guard.score=0.2", "guard.restart_s=0.5", "guard.reaction_s=0.6"]
"""The plan guard the deployed bundle ships (the tiny preset drives without one)."""


def check_post_processing_ships(bundle, gate, folder):
    """What was driven is what ships: gate.json records the guard the closed-loop gate drove with (and the network
    alone beside it); the runtime plans with it, exactly as the gate's drive did; `stack drive` drives the bundle
    with it and refuses other settings unless told; an edited setting fails verification, resealed or not."""
    from stack.deploy.bundle import BundleMismatch, seal, verify_bundle
    from stack.deploy.runner import DeployedNetwork

    recorded = gate["post_processing"]
    assert recorded["guard"]["score"] == 0.2 and recorded["guard"]["restart_s"] == 0.5
    assert gate["closed_loop"]["guard"] == recorded["guard"] and gate["closed_loop"]["fp32_alone"]["episodes"] == 2
    assert "fp32_alone" in (bundle / "report.md").read_text()
    net = DeployedNetwork.open(bundle, model="fp32", threads=1, allow_below_bar=True)
    assert net.post_processing.settings.score == 0.2
    assert_runtime_plans_as_the_gate_drove(bundle, net)
    refused = stack("drive", str(bundle), "guard.score=0.3", "--episodes", "1", f"drive.out_dir={folder / 'other'}")
    assert refused.returncode == 2 and "drives with the plan guard it was gated with" in refused.stderr
    assert "--experiment-guard" in refused.stderr and "Traceback" not in refused.stderr
    for resealed in (False, True):
        edited = folder / f"edited-{resealed}"
        shutil.copytree(bundle, edited)
        record = json.loads((edited / "gate.json").read_text())
        record["post_processing"]["guard"]["score"] = 0.3
        (edited / "gate.json").write_text(seal(record) if resealed else json.dumps(record))
        with pytest.raises(BundleMismatch, match="sha256" if not resealed else "post_processing.guard"):
            verify_bundle(edited)
        assert stack("deploy", "--verify", str(edited)).returncode == 1


def assert_runtime_plans_as_the_gate_drove(bundle, net):
    """On the frames of one driven episode, `DeployedNetwork.plan` (what a car runs) returns the trajectory the
    closed-loop gate's policy chose from the same model (`BundlePolicy`, the gate's guard settings)."""
    import numpy as np

    from stack.config import pipeline_from_yaml
    from stack.deploy.network_policies import BundlePolicy, bundle_spec, guard_spec, odometry
    from stack.sim.episode import run_episode
    from stack.sim.policies import Policy
    from stack.sim.scenarios import build_world, episode_specs

    pipeline = pipeline_from_yaml((bundle / "pipeline.yaml").read_text(), source="bundle")
    gate_policy = BundlePolicy(bundle_spec("fp32", "", str(bundle / "model.onnx"), guard=guard_spec(pipeline.guard)),
                               pipeline.model.planning_steps, pipeline)
    compared = []

    class Both(Policy):
        uses_cameras = True

        def plan(self, observation):
            driven = gate_policy.plan(observation)
            images = np.ascontiguousarray(observation.images.transpose(0, 3, 1, 2))[None]
            shipped = net.plan(images, observation.ego_status[None].astype(np.float32),
                               np.array([observation.command], np.int64), net.calibration, odometry(observation))
            compared.append(np.abs(driven - shipped).max())
            return driven

    spec = episode_specs(["stopped_vehicle"], 1, [0], 3.0)[0]
    world = build_world(spec, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
    run_episode(world, Both(gate_policy.spec, pipeline.model.planning_steps), pipeline.drive, pipeline.data.rig)
    assert compared and max(compared) == 0.0, compared


def test_deploy_orin_is_predicted_and_fails_an_unreachable_bar(tiny):
    checkpoint, overrides, folder = tiny
    result = stack("deploy", "--target", "orin", str(checkpoint), *overrides, "targets.orin.min_fps=100000",
                   "targets.orin.closed_loop.episodes=0")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:] + result.stdout[-3000:]
    bundle = folder / "export" / "orin"
    report = (bundle / "report.md").read_text()
    assert report.startswith("# Deploy report: orin — FAIL") and "PREDICTED" in report
    assert "trtexec --onnx=model.int8.onnx" in (bundle / "build_engine.sh").read_text()
    assert "below the required 100000 FPS" in result.stdout
    assert "quality: detection mAP " in result.stdout  # no --allow-below-bar: a failure
    assert "quality: closed loop not judged" in result.stdout  # closed_loop.episodes=0: nothing drove


def test_missing_checkpoint(tiny):
    assert_bad_input(stack("deploy", "--target", "orin", "runs/nope/last.ckpt"), "nope/last.ckpt", "does not exist")


def test_unknown_target(tiny):
    checkpoint, overrides, _ = tiny
    assert_bad_input(stack("deploy", "--target", "orni", str(checkpoint), *overrides), "unknown target 'orni'",
                     "Did you mean 'orin'")


def test_checkpoint_from_another_pipeline(tiny):
    checkpoint, overrides, _ = tiny
    assert_bad_input(stack("deploy", "--target", "orin", str(checkpoint), "-c", "configs/pipeline.yaml", *overrides),
                     "another pipeline", "model.backbone")


def test_calibration_set_too_small(tiny):
    checkpoint, overrides, _ = tiny
    assert_bad_input(stack("deploy", "--target", "cpu", str(checkpoint), *overrides, "export.calibration_samples=500"),
                     "calibration set too small", "export.calibration_samples")


@pytest.mark.serial
def test_bench_infer_scores_and_times_fp32_and_both_int8_flavours(tiny, tmp_path):
    import shutil

    checkpoint, overrides, folder = tiny
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    shutil.copyfile(checkpoint, train_dir / "model.pt")
    result = stack("bench", "infer", *TINY, *[o for o in overrides if "data." in o or "export." in o],
                   f"data.root={folder / 'data'}", f"train.out_dir={train_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert {row.split("|")[1].strip() for row in rows[1:]} == {"fp32", "int8 U8S8 (cpu flavour)",
                                                               "int8 S8S8 (tensorrt flavour)"}
