"""The real `stack` CLI in a subprocess: output, and every bad-input path (exit 2, no traceback)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stack.cli import build_parser
from stack.pipeline.migrations import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[2]


def stack(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "stack", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)


def assert_bad_input(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in: {result.stderr}"


def test_config_prints_the_resolved_pipeline():
    result = stack("config", "-c", "configs/pipeline.yaml", "-c", "configs/presets/tiny.yaml", "train.max_epochs=3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"# pipeline tiny (schema {SCHEMA_VERSION}, sha256 ")
    resolved = yaml.safe_load(result.stdout)
    assert resolved["train"]["max_epochs"] == 3
    assert resolved["data"]["rig"]["image_width"] == 256
    assert set(resolved["targets"]) >= {"orin", "ci-cpu"}


def test_wrong_type_names_key_and_expected_type():
    result = stack("config", "-c", "configs/pipeline.yaml", "train.max_epochs=abc")
    assert_bad_input(result, "train.max_epochs", "'abc'", "an integer")


def test_unknown_key_names_the_nearest_valid_key():
    assert_bad_input(stack("config", "model.backbon=x"), "model.backbon", "Nearest valid keys: model.backbone")


def test_out_of_range_value_names_key_value_and_allowed_range():
    assert_bad_input(stack("config", "data.world.val_fraction=2"), "data.world.val_fraction", "got 2.0",
                     "between 0.0 and 0.9")


def test_bad_choice_lists_the_choices():
    assert_bad_input(stack("config", "train.strategy=deepspeed"), "train.strategy", "'deepspeed'", "auto, ddp, fsdp")


def test_missing_config_file_names_the_path():
    assert_bad_input(stack("config", "-c", "configs/nope.yaml"), "configs/nope.yaml", "does not exist")


def test_unknown_key_in_a_file_names_the_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  depth:\n    binz: 3\n")
    assert_bad_input(stack("config", "-c", str(path)), str(path), "model.depth.binz", "model.depth.bins")


def test_wrong_type_in_a_file_names_the_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  rig:\n    cameras:\n      - name: front\n        hfov_deg: wide\n")
    assert_bad_input(stack("config", "-c", str(path)), str(path), "data.rig.cameras.0.hfov_deg", "a number")


@pytest.mark.parametrize("text,needle", [("model: [1, 2\n", "not valid YAML"), ("- 1\n- 2\n", "mapping")])
def test_malformed_yaml_is_reported(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert_bad_input(stack("config", "-c", str(path)), str(path), needle)


def test_override_without_equals_sign():
    assert_bad_input(stack("config", "train.max_epochs"), "key=value")


def test_list_index_out_of_range():
    assert_bad_input(stack("config", "data.rig.cameras.7.hfov_deg=80"), "data.rig.cameras.7", "indices 0..5")


def test_unknown_target_lists_known_targets():
    assert_bad_input(stack("config", "targets.orni.min_fps=1"), "'orni'", "orin")


def test_print_config_and_describe():
    result = stack("config", "--describe", "model.depth.bins")
    assert result.returncode == 0 and "Number of uniform bins" in result.stdout


def test_unknown_command_is_bad_input():
    result = stack("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


SHARED_OPTIONS = {"-h", "--help", "-c", "--config", "--print-config"}
COMMAND_OPTIONS = {"bench": {"--record", "--history",  # record a run's figures / compare against the history
                             "--check", "--update-baseline"},  # instruction counts against the stored baseline
                   "config": {"--describe"}, "data": {"--out", "--sample", "--from", "--source", "--version"},
                   "deploy": {"--target", "--verify", "--calibration", "--allow-below-bar"},
                   # the closed-loop command line the users asked for: --scenarios/--episodes map onto drive.* keys
                   # and --compare reads two finished drives (a mode, not a setting)
                   # --experiment-guard: drive a bundle with other guard settings than it ships, said in drive.md
                   "drive": {"--policy", "--scenarios", "--episodes", "--compare", "--experiment-guard"},
                   # the reference network's card is made of two reports and a folder
                   "reference": {"--eval", "--drive", "--folder", "--record"}, "export": {"--calibration"}, "eval": {"--split"}, "train": {"--dry-run"}}
"""Options each command may add beyond the shared ones. Config keys are never flags:
add a key to the schema instead (see stack/pipeline/)."""


def test_no_per_field_flags():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        flags = {flag for action in sub._actions for flag in action.option_strings}
        extra = flags - SHARED_OPTIONS - COMMAND_OPTIONS.get(name, set())
        assert not extra, f"`stack {name}` grew flags {extra}; make them pipeline keys, or list them here on purpose"


def test_bench_takes_key_value_overrides_and_record_paths_after_its_name():
    parser = build_parser()
    args, _ = parser.parse_known_args(["bench", "ops", "data.batch_size=2", "--record"])
    assert (args.name, args.overrides, args.record) == ("ops", ["data.batch_size=2"], "runs/bench-history")
    args, _ = parser.parse_known_args(["bench", "compare", "a.json", "b.json"])
    assert (args.name, args.overrides, args.history) == ("compare", ["a.json", "b.json"], None)


def test_every_bench_of_the_registry_is_a_function_of_the_installed_stages():
    """`stack.commands.bench.BENCHMARKS` is the one list of benches; `benchmarks/` (baselines, lab scripts) is not."""
    import importlib

    from stack.commands.bench import BENCHMARKS

    for name, target in BENCHMARKS.items():
        module, function = target.split(":")
        assert module.startswith("stack.") and callable(getattr(importlib.import_module(module), function)), name

def test_bench_compare_of_a_missing_record_is_bad_input(tmp_path):
    assert_bad_input(stack("bench", "compare", str(tmp_path / "old.json"), str(tmp_path / "new.json")),
                     "old.json' does not exist", "stack bench NAME --record")
