"""Hostile config files and values: each is refused with a message that says what to do (exit 2), never a
traceback, and an empty file never silently replaces the default pipeline."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stack.cli import main

REPO = Path(__file__).resolve().parents[2]


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def assert_bad_input(result, *needles):
    code, _, err = result
    assert code == 2, err
    assert err.startswith("stack config: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_dev_null_is_empty_not_missing():
    assert_bad_input(run_cli("config", "-c", "/dev/null"), "'/dev/null' is empty", "leave it out")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "{}\n", "~\n"])
def test_an_empty_config_file_is_an_error_not_a_reset(tmp_path, text):
    """`-c FILE` replaces configs/pipeline.yaml: an empty file would run the bare schema defaults."""
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert_bad_input(run_cli("config", "-c", str(path)), "is empty", "configs/pipeline.yaml")


def test_a_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: café\n".encode("latin-1"))
    assert_bad_input(run_cli("config", "-c", str(path)), "is not UTF-8", "0xe9", "offset 9")


def test_a_folder_given_as_config_file(tmp_path):
    assert_bad_input(run_cli("config", "-c", str(tmp_path)), "is a folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file; the folder case above covers unreadable input")
def test_an_unreadable_config_file(tmp_path):
    path = tmp_path / "secret.yaml"
    path.write_text("name: x\n")
    path.chmod(0)
    assert_bad_input(run_cli("config", "-c", str(path)), "cannot be read", "permissions")


@pytest.mark.parametrize("key", ["data.root", "train.out_dir", "export.out_dir"])
def test_a_folder_key_that_is_an_existing_file(tmp_path, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert_bad_input(run_cli("config", f"{key}={blocker}"), key, "is a file", "names a folder")
    assert_bad_input(run_cli("config", f"{key}={blocker / 'sub'}"), "lies under", "which is a file")


@pytest.mark.parametrize("text, needles", [
    ("data: 5\n", ["bad value for 'data'", "a DataConfig section", "found 5"]),
    ("data: [1]\n", ["bad value for 'data'", "found a list"]),
    ("targets: {orin: 5}\n", ["bad value for 'targets.orin'", "a Target section"]),
    ("targets: [1]\n", ["bad value for 'targets'", "found a list"]),
    ("targets: {5: {}}\n", ["'targets.5'", "found the key 5"]),
    ("targets: {null: {}}\n", ["'targets.None'", "found the key None"]),
    ("model: {bev: {x_range: {a: 1}}}\n", ["'model.bev.x_range'", "a list of numbers", "found a mapping"]),
    ("data: {world: {class_mix: [1]}}\n", ["'data.world.class_mix'", "found a list"]),
    ("train: {slurm_extra: [[1]]}\n", ["'train.slurm_extra.0': expected a string, found a list"]),
    ("train: {lr: .inf}\n", ["train.lr: got inf; must be a finite number"]),
    ("name: !!int x\n", ["is not valid YAML"]),
    ("a: &a [*a]\n", ["is not valid YAML"]),
])
def test_misshapen_files_name_the_key(tmp_path, text, needles):
    """These gave "bad value for '' (None)" or a traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run_cli("config", "-c", "configs/pipeline.yaml", "-c", str(path))
    assert_bad_input(result, *needles)
    assert "bad value for ''" not in result[2]


def test_sexagesimal_override_stays_a_string():
    code, out, err = run_cli("config", "train.slurm_time=12:00:00", "name=2026-01-01")
    assert code == 0, err
    assert "slurm_time: '12:00:00'" in out and "name: '2026-01-01'" in out


@pytest.mark.parametrize("args, needle", [
    (["-c", "/dev/null"], "is empty"),
    (["train.slurm_time=12:00:00; touch /tmp/stack-pwned"], "expected an sbatch time"),
    (["train.lr=1e999"], "must be a finite number"),
])
def test_through_the_real_cli(args, needle):
    result = subprocess.run([sys.executable, "-m", "stack", "config", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_closed_loop_episode_shorter_than_its_replanning_is_refused():
    from stack.config import load_pipeline
    from stack.errors import StackError

    with pytest.raises(StackError, match="episode_seconds.*two replanning periods"):
        load_pipeline([], ["drive.episode_seconds=0.04"])
    assert load_pipeline([], ["drive.episode_seconds=1.0"]).drive.episode_seconds == 1.0


# ---------------------------------------------------------------- interpolations


def test_a_config_may_refer_to_another_key():
    code, out, err = run_cli("config", "train.out_dir=${data.root}/train")
    assert code == 0 and "out_dir: runs/data/train" in out, err


@pytest.mark.parametrize("how", ["override", "file"])
@pytest.mark.parametrize("value", ["${oc.env:HOME}", "${oc.decode:'1'}", "a-${oc.env:HOME}-b"])
def test_no_config_calls_a_resolver(tmp_path, how, value):
    """`${oc.env:...}` would copy the environment into every artifact the run writes."""
    if how == "file":
        path = tmp_path / "mine.yaml"
        path.write_text(f"train:\n  out_dir: \"{value}\"\n")
        args = ["-c", str(path)]
    else:
        args = [f"train.out_dir={value}"]
    result = run_cli("config", *args)
    assert_bad_input(result, "train.out_dir holds", "never call a resolver", "Write the value itself")
    assert os.environ.get("HOME", "/nonexistent") not in result[2]


@pytest.mark.parametrize("value, needle", [("${nope.x}", "Interpolation key 'nope.x' not found"),
                                           ("${train.out_dir}", "Recursive interpolation")])
def test_an_interpolation_that_cannot_be_resolved_names_the_key(value, needle):
    assert_bad_input(run_cli("config", f"train.out_dir={value}"), "train.out_dir interpolates a value that cannot be "
                     "resolved", needle)


def test_a_pipeline_stored_in_a_checkpoint_is_read_without_resolvers(tmp_path):
    import torch

    from stack.checkpoint.model_file import load_model_checkpoint, save_model_checkpoint
    from stack.config import load_pipeline
    from stack.errors import StackError

    path = save_model_checkpoint(tmp_path / "model.pt", load_pipeline(), {"w": torch.zeros(1)})
    raw = torch.load(path, weights_only=True)
    raw["pipeline_yaml"] = raw["pipeline_yaml"].replace("out_dir: runs/train", "out_dir: ${oc.env:HOME}", 1)
    assert "${oc.env:HOME}" in raw["pipeline_yaml"]
    torch.save(raw, path)
    with pytest.raises(StackError, match=r"train.out_dir holds the interpolation '\$\{oc.env:HOME\}'; a pipeline "
                                         r"stored by `stack` holds resolved values only"):
        load_model_checkpoint(path)


@pytest.mark.parametrize("override, key", [
    ("drive.episodes=99999999999999999999", "episodes"), ("drive.latency_ms=1e12", "latency_ms"),
    ("drive.episode_seconds=1e9", "episode_seconds")])
def test_drive_counts_and_latencies_have_upper_bounds(override, key, capsys):
    """A typo must not start days of driving or an episode whose plans never arrive: exit 2 naming the key."""
    assert main(["config", override]) == 2
    err = capsys.readouterr().err
    assert f"drive.{key}" in err and "at most" in err and "Traceback" not in err


def test_drive_out_dir_that_is_a_file_is_refused_before_driving(tmp_path, capsys):
    from stack.config import load_pipeline
    from stack.errors import StackError
    from stack.sim.drive import drive
    from stack.sim.policies import PolicySpec

    target = tmp_path / "report"
    target.write_text("mine")
    pipeline = load_pipeline([], [f"drive.out_dir={target}", "drive.episodes=1"])
    with pytest.raises(StackError, match="is a file"):
        drive(pipeline, [PolicySpec("constant_velocity", "constant_velocity")])
    assert target.read_text() == "mine"


# ---------------------------------------------------------------- alias bombs ("billion laughs")


def alias_bomb(levels: int = 9) -> str:
    """YAML of `levels` anchors, each a list of nine aliases to the one before: 9**levels strings once expanded
    (9 levels: 387 million), a few hundred bytes on disk."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * 9)}]"]
    lines += [f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 9)}]" for level in range(1, levels)]
    return "\n".join(lines) + "\n"


def refused_quickly(call, *needles):
    """`call()` raises the project's config error naming every needle, before expanding the bomb: a generous
    30-second ceiling (a loaded machine stays far inside it), where expanding the 9-level bomb takes minutes
    and gigabytes."""
    import time

    from stack.errors import ConfigError

    start = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        call()
    assert time.monotonic() - start < 30.0
    for needle in needles:
        assert needle in str(raised.value), f"{needle!r} not in {str(raised.value)!r}"
    return str(raised.value)


def test_an_alias_bomb_config_file_is_refused_before_it_expands(tmp_path):
    from stack.config import load_pipeline

    path = tmp_path / "laughs.yaml"
    path.write_text("name: laughs\n" + alias_bomb())
    refused_quickly(lambda: load_pipeline([str(path)]), f"config file {str(path)!r}", "expands to more than 10,000",
                    "alias bomb", "without nested anchors")
    assert_bad_input(run_cli("config", "-c", str(path)), "alias bomb")


def test_an_alias_bomb_in_an_override_is_refused_before_it_expands():
    from stack.config import load_pipeline

    value = "[" + ", ".join(line.split(": ", 1)[1] for line in alias_bomb().splitlines()) + "]"
    refused_quickly(lambda: load_pipeline([], [f"data.aggregate={value}"]), "command-line override", "alias bomb")


def test_a_few_anchors_are_still_read(tmp_path):
    """Anchors are legal YAML and cheap when they stay small: only the expanded size is bounded."""
    from stack.config import load_pipeline

    path = tmp_path / "anchors.yaml"
    path.write_text("data:\n  aggregate: [runs/a, runs/b]\ndagger:\n  out_dir: &out runs/shared\n"
                    "drive:\n  out_dir: *out\n")
    pipeline = load_pipeline(["configs/pipeline.yaml", str(path)])
    assert pipeline.drive.out_dir == pipeline.dagger.out_dir == "runs/shared"


def test_an_alias_bomb_stored_in_a_checkpoint_is_refused_before_it_expands(tmp_path):
    import torch

    from stack.checkpoint.model_file import load_model_checkpoint, save_model_checkpoint
    from stack.config import load_pipeline

    path = save_model_checkpoint(tmp_path / "model.pt", load_pipeline(), {"w": torch.zeros(1)})
    raw = torch.load(path, weights_only=True)
    raw["pipeline_yaml"] += alias_bomb()
    torch.save(raw, path)
    refused_quickly(lambda: load_model_checkpoint(path), f"the pipeline stored in checkpoint {str(path)!r}",
                    "alias bomb", "edited or crafted")


@pytest.mark.parametrize("size, allowed", [(1, True), (65_536, True), (65_537, False), (10**9, False)])
def test_data_batch_size_has_an_upper_bound(size, allowed, capsys):
    """A stray digit must not ask the loader for a batch no machine holds: exit 2 naming the key and the range."""
    code = main(["config", f"data.batch_size={size}"])
    err = capsys.readouterr().err
    if allowed:
        assert code == 0, err
    else:
        assert code == 2 and "Traceback" not in err, err
        assert f"data.batch_size: got {size}; at most 65536 samples per rank" in err


# ---------------------------------------------------------------- upper bounds on every count and size

COUNTS = {  # key: (largest value accepted, how to write n of it)
    "data.samples_per_shard": 100_000, "data.rig.image_width": 8192, "data.rig.image_height": 8192,
    "data.world.scenes": 100_000, "data.world.frames_per_scene": 10_000, "data.world.agents_per_scene": 1_000,
    "data.world.frame_rate_hz": 100, "data.world.spawn_radius_m": 1_000,
    "model.neck_channels": 4096, "model.bev_channels": 4096, "model.planning_width": 4096, "model.max_boxes": 10_000,
    "model.planning_steps": 100, "model.planning_layers": 64, "model.path_points": 1024,
    "train.max_epochs": 1_000_000, "train.max_steps": 10**9, "train.warmup_steps": 10**9,
    "train.checkpoint_every_n_steps": 10**9, "train.log_every_n_steps": 10**9, "train.devices": 1024,
    "train.num_nodes": 100_000, "train.keep_checkpoints": 10_000, "train.profile_steps": 1_000,
    "train.slurm_cpus_per_task": 4_096, "export.batch_size": 256, "export.calibration_samples": 100_000,
    "export.accuracy_samples": 100_000, "export.sensitivity_samples": 10_000, "export.max_fp32_layers": 10_000,
    "export.timing_runs": 100_000, "export.timing_warmup": 10_000, "targets.orin.closed_loop.episodes": 100_000,
    "targets.orin.dla_core": 15, "targets.orin.device_multiprocessors": 4096, "targets.orin.camera_hz": 1_000,
    "drive.sim_hz": 1_000, "drive.clips": 1_000, "drive.best_clips": 100,
}


def configure(*overrides):
    """The pipeline's ConfigError message for these overrides on the default files, or None when they are valid."""
    from stack.config import load_pipeline
    from stack.errors import ConfigError

    try:
        load_pipeline(["configs/pipeline.yaml"], list(overrides))
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("key", sorted(COUNTS))
def test_every_count_and_size_has_an_upper_bound(key, monkeypatch):
    """A typo (an extra digit, a byte count) must not start days of work or ask for memory no machine has:
    one past the bound is refused naming the key, the bound and a typical value; the bound itself is accepted."""
    monkeypatch.chdir(REPO)
    high = COUNTS[key]
    extra = ["model.planning_modes=1", "model.planning_accelerations=[0.0]"] if key == "model.path_points" else []
    assert configure(f"{key}={high}", *extra) is None
    message = configure(f"{key}={high + 1}", *extra)
    assert message and f"{key}: got {high + 1}; at most {high} " in message and "e.g." in message, message


@pytest.mark.parametrize("override, needle", [
    ("train.slurm_signal_seconds=65536", "train.slurm_signal_seconds: got 65536; at most 65535 s (sbatch --signal"),
    ("data.rig.cameras=[" + ", ".join(f"{{name: c{i}}}" for i in range(33)) + "]",
     "data.rig.cameras: got 33; at most 32 cameras"),
    ("model.planning_accelerations=[" + ", ".join(str(-12 + i / 16) for i in range(257)) + "]",
     "model.planning_accelerations: got 257; at most 256 accelerations"),
    ("model.segmentation_classes=[" + ", ".join(f"c{i}" for i in range(256)) + "]",
     "model.segmentation_classes: got 256; at most 255 classes (semantic ids are stored as uint8"),
    ("drive.seeds=[" + ", ".join(map(str, range(1001))) + "]", "drive.seeds: got 1001; at most 1000 seeds"),
    ("model.bev.cell_size=0.0001", "model.bev.x_range: got [-51.2, 51.2] at cell_size 0.0001: 1024000 cells; at "
                                   "most 2048"),
])
def test_lists_rates_and_grids_have_upper_bounds(override, needle, monkeypatch):
    monkeypatch.chdir(REPO)
    message = configure(override, "train.slurm_time=2-00:00:00")
    assert message and needle in message, message


def test_an_upper_bound_through_the_cli_is_exit_2_without_traceback(capsys):
    assert main(["config", "export.timing_runs=1000000000000"]) == 2
    err = capsys.readouterr().err
    assert "export.timing_runs: got 1000000000000; at most 100000 runs per model" in err and "Traceback" not in err
