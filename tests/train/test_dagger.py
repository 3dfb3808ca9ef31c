"""`stack dagger` (stack.train.dagger): the student drives training episodes mixed with the expert, every state
it visits is written with the expert's label, the aggregate trains the next student, and the iterations are
reported; bad input is refused before anything is written."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from stack.cli import main
from stack.config import load_pipeline
from stack.errors import StackError

REPO = Path(__file__).resolve().parents[2]
MICRO = ["data.rig.image_width=128", "data.rig.image_height=64", "model.bev.x_range=[-16.0,16.0]",
         "model.bev.y_range=[-16.0,16.0]", "model.depth.bins=16", "model.neck_channels=16", "model.bev_channels=16",
         "data.world.scenes=3", "data.world.frames_per_scene=2", "data.world.agents_per_scene=8",
         "data.world.val_fraction=0.34", "data.world.render_device=cpu", "data.samples_per_shard=4",
         "data.num_workers=0", "data.batch_size=2", "drive.episode_seconds=3.0", "drive.workers=1",
         "train.tracking_uri=off", "train.precision=32-true", "train.checkpoint_every_n_steps=1000",
         "train.log_every_n_steps=1", "dagger.iterations=2", "dagger.episodes=2", "dagger.steps=2"]


def micro(tmp: Path, *extra: str):
    return load_pipeline([str(REPO / "configs/pipeline.yaml"), str(REPO / "configs/presets/tiny.yaml")],
                         [*MICRO, f"data.root={tmp / 'data'}", f"dagger.out_dir={tmp / 'dagger'}", *extra])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(folder, pipeline, model.pt): a rendered micro dataset and an untrained network's checkpoint."""
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.data.make import make_dataset
    from stack.models import build_model

    tmp = tmp_path_factory.mktemp("dagger")
    pipeline = micro(tmp)
    make_dataset(pipeline, log=lambda *_: None)
    torch.manual_seed(0)
    weights = save_model_checkpoint(tmp / "model.pt", pipeline, build_model(pipeline).state_dict())
    return tmp, pipeline, weights


@pytest.fixture(scope="module")
def dagger_run(prepared):
    from stack.deploy.network_policies import CheckpointPolicy
    from stack.train.dagger import run_dagger

    tmp, pipeline, weights = prepared
    lines = []
    summary = run_dagger(pipeline, weights, CheckpointPolicy, log=lines.append)
    return summary, lines


def test_each_iteration_records_the_students_states_with_expert_labels_and_fine_tunes(prepared, dagger_run):
    from stack.data import build_loader
    from stack.data.loader import read_manifest

    tmp, pipeline, weights = prepared
    summary, lines = dagger_run
    out = tmp / "dagger"
    assert [row["iteration"] for row in summary["iterations"]] == [1, 2]
    assert [row["beta"] for row in summary["iterations"]] == [0.5, 0.25]
    for row in summary["iterations"]:
        manifest = read_manifest(out / f"iteration-{row['iteration']}" / "data")
        recorded = sum(shard["samples"] for shard in manifest["splits"]["train"])
        assert recorded == row["frames"] > 0 and manifest["closed_loop_episodes"] == 2
        assert 0.0 <= row["driving_score"] <= 1.0 and 0.0 <= row["pdms"] <= 1.0
        assert Path(row["weights_out"]).is_file()
    second = summary["iterations"][1]
    assert second["weights_driven"] == summary["iterations"][0]["weights_out"], "iteration 2 drives iteration 1's student"
    # every iteration's frames join training: the loader's train split holds data.root's and both recordings
    base = sum(s["samples"] for s in read_manifest(pipeline.data.root)["splits"]["train"])
    aggregated = load_pipeline([], [*MICRO, f"data.root={pipeline.data.root}",
                                    f"data.aggregate=[{','.join(summary['aggregate'])}]"])
    loader = build_loader(aggregated, "train", rank=0, world_size=1, shuffle=False, augment=False)
    assert sum(count for _, count in loader.shards) == base + sum(r["frames"] for r in summary["iterations"])
    batch = next(iter(loader))
    assert batch.future_trajectory.shape[1:] == (aggregated.model.planning_steps, 2)
    # fine-tuning changed the weights, the last model is the summary's, and the report exists
    before = torch.load(weights, weights_only=True)["state_dict"]
    after = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())
    assert json.loads((out / "dagger.json").read_text())["model"] == str(out / "model.pt")
    assert (out / "dagger.png").stat().st_size > 1000
    assert any("DAgger iteration 2" in line for line in lines)


def test_recorded_frames_carry_their_provenance(dagger_run, prepared):
    import io
    import tarfile

    tmp = prepared[0]
    shard = sorted((tmp / "dagger" / "iteration-1" / "data" / "train").glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        names = tar.getnames()
        key = names[0].split(".")[0]
        meta = json.loads(tar.extractfile(f"{key}.meta.json").read())
        future = np.load(io.BytesIO(tar.extractfile(f"{key}.future.npy").read()))
    assert meta["source"] == "closed_loop" and "DAgger iteration 1" in meta["driver"] and meta["family"]
    assert future.shape == (prepared[1].model.planning_steps, 2) and np.isfinite(future).all()


def test_dagger_iterations_never_drive_an_evaluation_world(prepared):
    from stack.sim.scenarios import episode_specs, rng_words
    from stack.train.dagger import iteration_specs

    pipeline = prepared[1]
    drive = pipeline.drive
    held_out = {tuple(rng_words(s, pipeline.data.world))
                for s in episode_specs(drive.scenarios, 500, drive.seeds, drive.episode_seconds)}
    seen = set()
    for iteration in (1, 2, 3):
        words = {tuple(rng_words(s, pipeline.data.world)) for s in iteration_specs(pipeline, iteration)}
        assert not words & held_out and not words & seen, "each iteration drives new training worlds only"
        seen |= words


def test_an_earlier_run_is_kept_unless_overwrite_and_bad_input_exits_2(prepared, dagger_run, capsys):
    tmp, pipeline, weights = prepared
    before = (tmp / "dagger" / "dagger.json").read_text()
    files = ["-c", str(REPO / "configs/pipeline.yaml"), "-c", str(REPO / "configs/presets/tiny.yaml")]
    common = [*MICRO, f"data.root={pipeline.data.root}", f"dagger.out_dir={tmp / 'dagger'}"]
    assert main(["dagger", str(weights), *files, *common]) == 2
    assert "dagger.overwrite=true" in capsys.readouterr().err
    assert (tmp / "dagger" / "dagger.json").read_text() == before, "a refused run must not touch the earlier one"
    assert main(["dagger", *files, *common]) == 2
    assert "needs one CHECKPOINT" in capsys.readouterr().err
    stranger = tmp / "stranger"
    stranger.mkdir()
    (stranger / "thesis.tex").write_text("mine")
    assert main(["dagger", str(weights), *files, *MICRO, f"data.root={pipeline.data.root}",
                 f"dagger.out_dir={stranger}", "dagger.overwrite=true"]) == 2
    assert (stranger / "thesis.tex").read_text() == "mine"


def test_fine_tuning_starts_at_dagger_lr_scale_of_the_training_rate(prepared, tmp_path, monkeypatch, capsys):
    """dagger.lr_scale sets each fine-tuning's peak learning rate as a share of train.lr (its schedule: dagger.steps);
    a share outside (0, 1] is refused before anything runs."""
    import stack.train.fit
    from stack.train.dagger import fine_tune

    tmp, pipeline, weights = prepared
    seen = []
    monkeypatch.setattr(stack.train.fit, "fit", lambda tuned, model: seen.append(tuned.train))
    for scale in (1.0, 0.1):
        fine_tune(micro(tmp, f"dagger.lr_scale={scale}"), weights, [], tmp_path / f"tune-{scale}")
    assert [(t.lr, t.max_steps) for t in seen] == [(pipeline.train.lr, 2), (pytest.approx(0.1 * pipeline.train.lr), 2)]
    files = ["-c", str(REPO / "configs/pipeline.yaml"), "-c", str(REPO / "configs/presets/tiny.yaml")]
    for bad in ("0", "1.5"):
        assert main(["dagger", str(weights), *files, *MICRO, f"data.root={pipeline.data.root}",
                     f"dagger.out_dir={tmp_path / 'refused'}", f"dagger.lr_scale={bad}"]) == 2
        assert "dagger.lr_scale" in capsys.readouterr().err and not (tmp_path / "refused").exists()


def test_aggregating_a_dataset_of_another_rig_is_refused(prepared, tmp_path):
    from stack.data import build_loader
    from stack.data.make import make_dataset

    tmp, pipeline, _ = prepared
    other = micro(tmp_path, "data.rig.image_width=96")
    make_dataset(other, log=lambda *_: None)
    mixed = load_pipeline([], [*MICRO, f"data.root={pipeline.data.root}", f"data.aggregate=[{other.data.root}]"])
    with pytest.raises(StackError, match="image_size"):
        build_loader(mixed, "train", rank=0, world_size=1)


# ----------------------------------------------------------------------------- what dagger.overwrite may delete

FILES = ["-c", str(REPO / "configs/pipeline.yaml"), "-c", str(REPO / "configs/presets/tiny.yaml")]


def earlier_run(folder: Path) -> dict:
    """A DAgger run's outputs in `folder` beside files of the user's; returns {user path: content}."""
    (folder / "iteration-1" / "train").mkdir(parents=True)
    (folder / "iteration-1" / "train" / "model.pt").write_bytes(b"old weights")
    (folder / "iteration-2").mkdir()
    for name in ("dagger.json", "dagger.png", "model.pt"):
        (folder / name).write_text(f"earlier {name}")
    mine = {folder / "notes.md": "my notes", folder / "iteration-notes.txt": "mine too",
            folder / "plots" / "mine.png": "my plot"}
    for path, text in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return mine


def dagger_outputs(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("iteration-") and p.is_dir()
                  or p.name in ("dagger.json", "dagger.png", "model.pt"))


def never_drive(monkeypatch):
    """Driving an episode fails the test: every refusal below must come before the first one."""
    import stack.sim.drive

    def drove(*_, **__):
        raise AssertionError("stack dagger drove an episode before checking its inputs")

    monkeypatch.setattr(stack.sim.drive, "evaluate", drove)


def test_overwrite_removes_only_what_a_dagger_run_wrote(prepared, tmp_path):
    from stack.train.dagger import prepare_out_dir

    tmp, pipeline, weights = prepared
    out = tmp_path / "dagger"
    mine = earlier_run(out)
    prepare_out_dir(micro(tmp, f"dagger.out_dir={out}", "dagger.overwrite=true"))
    assert dagger_outputs(out) == [], "the earlier run's outputs are gone"
    assert {path: path.read_text() for path in mine} == mine, "the user's files are kept"


def test_a_symlinked_out_dir_is_emptied_inside_and_a_dangling_one_is_refused(prepared, tmp_path):
    from stack.train.dagger import prepare_out_dir

    tmp = prepared[0]
    target, link = tmp_path / "elsewhere", tmp_path / "dagger"
    mine = earlier_run(target)
    link.symlink_to(target)
    prepare_out_dir(micro(tmp, f"dagger.out_dir={link}", "dagger.overwrite=true"))
    assert link.is_symlink() and dagger_outputs(target) == [] and all(p.read_text() == t for p, t in mine.items())
    # an iteration folder that is a link elsewhere is not the run's: refused, and its target kept
    (target / "dagger.json").write_text("{}")
    (target / "iteration-1").symlink_to(tmp_path / "precious", target_is_directory=True)
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "data.bin").write_text("keep")
    with pytest.raises(StackError, match="symbolic link"):
        prepare_out_dir(micro(tmp, f"dagger.out_dir={link}", "dagger.overwrite=true"))
    assert (tmp_path / "precious" / "data.bin").read_text() == "keep" and (target / "dagger.json").is_file()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "missing")
    with pytest.raises(StackError, match="symbolic link to .*missing.* which does not exist"):
        prepare_out_dir(micro(tmp, f"dagger.out_dir={dangling}"))


def test_a_source_checkpoint_inside_the_folder_overwrite_would_empty_is_refused(prepared, tmp_path, monkeypatch,
                                                                               capsys):
    """Continuing from the last result (`stack dagger runs/x/dagger/model.pt ... dagger.out_dir=runs/x/dagger
    dagger.overwrite=true`) deleted the checkpoint before loading it."""
    tmp, pipeline, weights = prepared
    never_drive(monkeypatch)
    out = tmp_path / "dagger"
    mine = earlier_run(out)
    for source in (out / "model.pt", out / "iteration-1" / "train" / "model.pt"):
        source.write_bytes(weights.read_bytes())
        assert main(["dagger", str(source), *FILES, *MICRO, f"data.root={pipeline.data.root}",
                     f"dagger.out_dir={out}", "dagger.overwrite=true"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(source) in err and "copy it elsewhere" in err, err
        assert source.read_bytes() == weights.read_bytes()
    assert dagger_outputs(out) == ["dagger.json", "dagger.png", "iteration-1", "iteration-2", "model.pt"]
    assert all(p.read_text() == t for p, t in mine.items())


def test_a_second_dagger_into_a_folder_being_written_is_refused_before_it_deletes(prepared, tmp_path, monkeypatch,
                                                                                 capsys):
    """Two `stack dagger` runs into one out_dir would clear and mix each other's iterations: while one holds the
    folder's writer lock, another (even with dagger.overwrite=true) exits 2 with nothing deleted or driven."""
    import fcntl
    import os

    tmp, pipeline, weights = prepared
    never_drive(monkeypatch)
    out = tmp_path / "dagger"
    mine = earlier_run(out)
    handle = os.open(out, os.O_RDONLY)  # what the running `stack dagger` holds (stack.locks)
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert main(["dagger", str(weights), *FILES, *MICRO, f"data.root={pipeline.data.root}",
                     f"dagger.out_dir={out}", "dagger.overwrite=true"]) == 2
    finally:
        os.close(handle)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "another `stack dagger` is writing" in err, err
    assert dagger_outputs(out) == ["dagger.json", "dagger.png", "iteration-1", "iteration-2", "model.pt"]
    assert all(p.read_text() == t for p, t in mine.items())


@pytest.mark.parametrize("case", ["under-a-file", "no-dataset", "clips-dataset", "no-train-split", "aggregate-missing",
                                  "garbage-checkpoint", "other-rig"])
def test_every_input_is_checked_before_the_first_episode(prepared, tmp_path, monkeypatch, capsys, case):
    tmp, pipeline, weights = prepared
    never_drive(monkeypatch)
    out, root, source = tmp_path / "dagger", Path(pipeline.data.root), weights
    extra, needle = [], ""
    if case == "under-a-file":
        (tmp_path / "results").write_text("a file of mine")
        out, needle = tmp_path / "results" / "dagger", "which is a file"
    elif case == "no-dataset":
        root, needle = tmp_path / "nothing", "no dataset at"
    elif case in ("clips-dataset", "no-train-split", "other-rig"):
        root = tmp_path / "edited"
        shutil.copytree(pipeline.data.root, root)
        manifest = json.loads((root / "manifest.json").read_text())
        if case == "clips-dataset":
            manifest["layout"], needle = "clips", "holds clips shards"
        elif case == "no-train-split":
            manifest["splits"]["train"], needle = [], "split 'train'"
        else:
            manifest["image_size"], needle = [64, 96], "data.rig is not the cameras"
        (root / "manifest.json").write_text(json.dumps(manifest))
    elif case == "aggregate-missing":
        extra, needle = [f"data.aggregate=[{tmp_path / 'gone'}]"], "gone"
    else:
        source = tmp_path / "model.pt"
        source.write_bytes(b"not a checkpoint")
        needle = "model.pt"
    code = main(["dagger", str(source), *FILES, *MICRO, f"data.root={root}", f"dagger.out_dir={out}", *extra])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not out.exists(), "nothing is written before the inputs are checked"
    if case == "under-a-file":
        assert (tmp_path / "results").read_text() == "a file of mine"


def test_a_run_killed_mid_iteration_is_refused_then_overwritten_cleanly(prepared, tmp_path, capsys):
    """SIGKILL while iteration 1's frames are written (after its episodes were driven): no summary or model.pt
    claims a result; the next run refuses the folder, and dagger.overwrite=true removes the partial run only."""
    import os
    import signal
    import subprocess
    import sys

    from stack.train.dagger import prepare_out_dir

    tmp, pipeline, weights = prepared
    out = tmp_path / "dagger"
    command = [sys.executable, "-m", "stack", "dagger", str(weights), *FILES, *MICRO, f"data.root={pipeline.data.root}",
               f"dagger.out_dir={out}", "dagger.iterations=1", "dagger.episodes=1"]
    killed = subprocess.run(command, env={**os.environ, "STACK_FAIL_POINT": "shard-write"}, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (out / "iteration-1").is_dir() and not (out / "dagger.json").exists() and not (out / "model.pt").exists()
    (out / "notes.md").write_text("mine")
    assert main(["dagger", str(weights), *FILES, *MICRO, f"data.root={pipeline.data.root}", f"dagger.out_dir={out}"]) == 2
    assert "holds an earlier DAgger run" in capsys.readouterr().err
    prepare_out_dir(micro(tmp, f"dagger.out_dir={out}", "dagger.overwrite=true"))
    assert sorted(p.name for p in out.iterdir()) == ["notes.md"] and (out / "notes.md").read_text() == "mine"
