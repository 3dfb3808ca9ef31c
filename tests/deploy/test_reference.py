"""The pinned reference network (models/reference/tiny-drive): it loads without unpickling, today's code replays its
frames to its pinned outputs and plans, a change to the network or its post-processing fails the replay, a new
training is judged against its card, and the closed-loop bar fails the weakened networks it ships beside."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from stack.deploy import reference

REPO = Path(__file__).resolve().parents[2]
PINNED = REPO / reference.REFERENCE_DIR


def test_the_pinned_network_loads_without_unpickling_and_carries_its_pipeline(monkeypatch):
    import torch

    from stack.checkpoint.model_file import load_model_checkpoint
    from stack.pipeline import migrate_guard_settings

    def refuse(*args, **kwargs):
        raise AssertionError("the pinned network must load without torch.load (no pickle)")

    monkeypatch.setattr(torch, "load", refuse)
    pipeline, state_dict, meta = load_model_checkpoint(PINNED / reference.MODEL_FILE)
    assert meta["format"] == "stack-model" and pipeline.guard.score > 0 and pipeline.model.temporal_frames == 1
    assert (PINNED / reference.MODEL_FILE).stat().st_size < 12e6  # the card's promise: about 12 MB at most
    card = json.loads((PINNED / reference.CARD_JSON).read_text())
    assert card["network"]["sha256"] == reference.sha256_file(PINNED / reference.MODEL_FILE)
    # its guard as the card recorded it, at pipeline schema 2, with the rules schema 3 removed off
    assert migrate_guard_settings(card["post_processing"]["guard"]) == pipeline.guard.settings()


def test_todays_code_replays_the_pinned_outputs_and_plans():
    assert reference.replay(PINNED) == []


def test_the_replay_has_frames_where_the_post_processing_changes_the_plan():
    """Otherwise a broken plan guard would replay unnoticed."""
    _, pinned, _ = reference.read_replay(PINNED / reference.REPLAY_FILE)
    assert any(np.abs(out["plan"] - out["plan_alone"]).max() > 1.0 for out in pinned)


def _copy(tmp_path) -> Path:
    folder = tmp_path / "reference"
    shutil.copytree(PINNED, folder)
    return folder


@pytest.mark.parametrize("header, arrays, needle", [
    ("[" * 200_000 + "]" * 200_000, None, "nested more than 64 levels deep"),
    ('{"frames": 1000000000000}', None, "its header names 1000000000000 frames"),
    ('{"frames": "3"}', None, "its header names '3' frames"),
    ('{"frames": 1}', {"frame7.input.ego": np.zeros(3, np.float32)}, "array frame7.input.ego is not frame{0..0}"),
    ('{"frames": 1}', {"frame0.sideways.ego": np.zeros(3, np.float32)}, "array frame0.sideways.ego is not"),
    ('{"frames": 1}', {"frame\u00b2.input.ego": np.zeros(3, np.float32)}, "is not frame{0..0}.input.NAME"),
    (None, None, "without the `stack` header"),
])
def test_a_hostile_replay_file_is_refused_in_one_line(tmp_path, header, arrays, needle):
    """The replay's header is JSON and its keys name frames: a deep header, a frame count that would allocate
    a trillion dicts, keys outside the frames are one StackError, not a RecursionError, MemoryError or IndexError."""
    from safetensors.numpy import save_file

    from stack.errors import StackError

    path = tmp_path / reference.REPLAY_FILE
    save_file(arrays or {"frame0.input.ego": np.zeros(3, np.float32)}, str(path),
              metadata=None if header is None else {"stack": header})
    with pytest.raises(StackError) as caught:
        reference.read_replay(path)
    assert needle in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_a_changed_weight_fails_the_replay(tmp_path):
    from stack.checkpoint.model_file import load_model_checkpoint, save_safetensors_checkpoint
    from stack.config import pipeline_hash, pipeline_to_yaml

    folder = _copy(tmp_path)
    pipeline, state_dict, _ = load_model_checkpoint(folder / reference.MODEL_FILE)
    name = max(k for k in state_dict if k.startswith("planning_head.scorer.") and k.endswith(".weight"))
    state_dict[name] = state_dict[name] * 1.05  # the planner's last scoring layer 5% off
    save_safetensors_checkpoint(folder / reference.MODEL_FILE, pipeline_to_yaml(pipeline), pipeline_hash(pipeline),
                                state_dict)
    problems = reference.replay(folder)
    assert problems and any("plan_scores" in p or "plan_trajectories" in p for p in problems), problems


def test_a_changed_guard_setting_fails_the_replay(tmp_path):
    from stack.checkpoint.model_file import load_model_checkpoint, save_safetensors_checkpoint
    from stack.config import pipeline_hash, pipeline_to_yaml

    folder = _copy(tmp_path)
    pipeline, state_dict, _ = load_model_checkpoint(folder / reference.MODEL_FILE)
    from dataclasses import replace

    unguarded = replace(pipeline, guard=replace(pipeline.guard, score=0.0))
    save_safetensors_checkpoint(folder / reference.MODEL_FILE, pipeline_to_yaml(unguarded), pipeline_hash(unguarded),
                                state_dict)
    problems = reference.replay(folder)
    assert problems and all(re.match(r"frame \d plan:", p) for p in problems), problems


def test_reproduce_passes_the_card_and_fails_a_worse_training(tmp_path):
    card = json.loads((PINNED / reference.CARD_JSON).read_text())
    metrics = dict(card["eval"])
    drive = {"meta": {}, "rows": [{"policy": reference.NETWORK, "metrics": {
        "driving_score": card["closed_loop"]["policies"][reference.NETWORK]["driving_score"]["mean"],
        "pdms": card["closed_loop"]["policies"][reference.NETWORK]["pdms"]["mean"], "collisions": 0.0,
        "route_completion": 1.0}}]}
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    (tmp_path / "drive.json").write_text(json.dumps(drive))
    assert reference.reproduce(PINNED, tmp_path / "metrics.json", tmp_path / "drive.json")["passed"]
    drive["rows"][0]["metrics"]["driving_score"] -= 0.1  # drives worse than the seed spread allows
    (tmp_path / "drive.json").write_text(json.dumps(drive))
    worse = reference.reproduce(PINNED, tmp_path / "metrics.json", tmp_path / "drive.json")
    assert not worse["passed"] and any("driving_score" in line and "OUT" in line for line in worse["lines"])
    metrics["detection/mAP"] -= 0.1  # a detector that learned less
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    drive["rows"][0]["metrics"]["driving_score"] += 0.1
    (tmp_path / "drive.json").write_text(json.dumps(drive))
    worse = reference.reproduce(PINNED, tmp_path / "metrics.json", tmp_path / "drive.json")
    assert not worse["passed"] and any(line.startswith("detection/mAP") and "OUT" in line for line in worse["lines"])


def test_reference_commands_refuse_bad_input_with_exit_2(tmp_path, capsys):
    from stack.cli import main

    assert main(["reference"]) == 2
    assert main(["reference", "frobnicate"]) == 2
    assert main(["reference", "reproduce", "--eval", str(tmp_path / "none.json"), "--drive", "x"]) == 2
    (tmp_path / "bad.json").write_text("[1, 2")
    assert main(["reference", "reproduce", "--eval", str(tmp_path / "bad.json"), "--drive", str(tmp_path / "bad.json")]) == 2
    assert main(["reference", "replay", "--folder", str(tmp_path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


WEAKENED_EPISODES = 28
"""The first 28 of the gate's held-out episodes (four of each family): the untrained network drives far below the
ego-status rollout; the pinned network alone fails the bar on all 112 (+0.042 [-0.007, +0.095] driving score,
card.md) and, with an interval twice as wide, on these 28; 28 keep this test to about a minute on two cores."""


TINY_DRIVE = ["configs/pipeline.yaml", "configs/presets/tiny.yaml", "configs/presets/tiny-drive.yaml"]


def _gate_keys() -> list[str]:
    """The key=value words `make test` deploys and drives the reference network with (the Makefile's REFERENCE_KEYS,
    after its config files: $(TINY_DRIVE))."""
    found = re.search(r"^REFERENCE_KEYS := \$\(TINY_DRIVE\) (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile names REFERENCE_KEYS: the tiny-drive preset, then keys"
    return [word.strip('"') for word in found.group(1).split()]


@pytest.mark.slow
def test_the_gates_bar_fails_an_untrained_network_and_the_reference_network_without_its_post_processing(tmp_path):
    """The harness `make test` ships the reference network through (its held-out episodes, the ci-cpu target's
    latency, the closed-loop bar against both blind policies) fails the weakened networks: the same network
    untrained, and the pinned one driving its planner's own choice (its plan guard off)."""
    from dataclasses import replace

    from stack.checkpoint.model_file import load_for_deploy, save_model_checkpoint
    from stack.deploy.network_policies import checkpoint_spec, guard_spec, network_alone
    from stack.models import build_model
    from stack.sim.drive import drive
    from stack.sim.policies import PolicySpec

    pinned_path = str(PINNED / reference.MODEL_FILE)
    keys = _gate_keys() + [f"drive.episodes={WEAKENED_EPISODES}", f"drive.out_dir={tmp_path / 'drive'}",
                           "drive.clips=0", "drive.best_clips=0"]
    pipeline, _, _ = load_for_deploy(pinned_path, [str(REPO / f) for f in TINY_DRIVE], keys)
    pipeline = replace(pipeline, drive=replace(pipeline.drive, latency_ms=pipeline.targets["ci-cpu"].latency_budget_ms()))
    untrained = save_model_checkpoint(tmp_path / "untrained.pt", pipeline, build_model(pipeline).state_dict())
    pinned = checkpoint_spec("reference", pinned_path, guard=guard_spec(pipeline.guard))
    specs = [checkpoint_spec("untrained", str(untrained), guard=guard_spec(pipeline.guard)), network_alone(pinned),
             PolicySpec("constant_velocity", "constant_velocity"), PolicySpec("ego_rollout", "ego_rollout")]
    bars = drive(pipeline, specs, log=lambda line: None)["bar"]
    assert bars["untrained"]["passed"] is False, bars["untrained"]
    assert bars["reference alone"]["passed"] is False, bars["reference alone"]
