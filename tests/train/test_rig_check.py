"""The pipeline's rig must be the dataset's cameras before training or evaluation (names, count, image size and
each camera's mount within tolerance): the loaders read the cameras the manifest lists, so another rig trained
without a word on cameras it does not describe."""

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from stack.cli import main
from stack.config import load_pipeline

SMALL = ["data.rig.image_width=64", "data.rig.image_height=32", "data.world.scenes=2", "data.world.frames_per_scene=2",
         "data.world.agents_per_scene=4", "data.world.val_fraction=0.5", "data.world.render_device=cpu",
         "data.world.workers=0", "data.batch_size=1", "data.num_workers=0", "model.backbone=resnet10t",
         "model.neck_channels=16", "model.bev_channels=16", "model.bev.cell_size=3.2", "model.depth.bins=8",
         "model.max_boxes=16", "train.accelerator=cpu", "train.max_steps=1", "train.tracking_uri=off"]
WRONG = {
    "data.rig.cameras.0.name=frontx": "cameras: data.rig has 6 (frontx, front_left, front_right, back, back_left, "
                                      "back_right), the dataset 6 (front, front_left,",
    "data.rig.cameras=[{name: front}]": "cameras: data.rig has 1 (front), the dataset 6 (front, front_left,",
    "data.rig.cameras.0.yaw_deg=40": "camera 0 (front): orientation yaw_deg=40, pitch_deg=0 in data.rig, "
                                     "yaw_deg=0.00, pitch_deg=0.00 in the data (degrees)",
    "data.rig.cameras.4.x=2.5": "camera 4 (back_left): position x=2.5, y=0.5, z=1.6 in data.rig, x=0.00, y=0.50, "
                                "z=1.60 in the data (m)",
    "data.rig.cameras.3.hfov_deg=90": "camera 3 (back): field of view hfov_deg=90 in data.rig, hfov_deg=110.00 in "
                                      "the data (degrees)",
    "data.rig.image_width=128": "image size: data.rig 128x32, the dataset 64x32",
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from stack.data.make import make_dataset

    root = tmp_path_factory.mktemp("world")
    make_dataset(load_pipeline(overrides=[*SMALL, f"data.root={root}"]), log=lambda *_: None)
    return root


def cli(*argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize("override", sorted(WRONG))
def test_train_refuses_a_rig_that_is_not_the_datasets_before_anything_starts(shards, tmp_path, override):
    out = tmp_path / "out"
    code, err = cli("train", *SMALL, f"data.root={shards}", f"train.out_dir={out}", override)
    assert code == 2 and "Traceback" not in err, err
    assert f"data.rig is not the cameras of the dataset at {shards} that it would train on" in err
    assert WRONG[override] in err and "Set data.rig to the cameras the data was recorded with" in err
    assert not out.exists()


def test_eval_refuses_a_checkpoint_whose_rig_is_not_the_datasets(shards, tmp_path):
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.models import build_model

    pipeline = load_pipeline(overrides=[*SMALL, f"data.root={shards}", "data.rig.cameras.0.yaw_deg=40"])
    path = save_model_checkpoint(tmp_path / "model.pt", pipeline, build_model(pipeline).state_dict())
    code, err = cli("eval", str(path))
    assert code == 2 and "Traceback" not in err, err
    assert f"that checkpoint {path} would be evaluated on" in err and WRONG["data.rig.cameras.0.yaw_deg=40"] in err
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("override", ["data.rig.cameras.0.yaw_deg=3", "data.rig.cameras.2.pitch_deg=-4",
                                      "data.rig.cameras.1.x=1.2", "data.rig.cameras.5.hfov_deg=73"])
def test_a_rig_within_tolerance_of_the_recorded_cameras_is_accepted(shards, override):
    """Calibrations of one rig differ by centimetres and a degree or two (each sample carries its own): accepted."""
    from stack.data.camera_records import check_rig

    pipeline = load_pipeline(overrides=[*SMALL, f"data.root={shards}", override])
    check_rig(pipeline.data.rig, Path(shards), "train", "it would train on")


def test_drive_refuses_a_checkpoint_trained_on_other_cameras_than_its_rig(shards, tmp_path):
    """A model.pt trained before `stack train` checked the rig (its lineage names the six cameras it saw, its rig
    one) would drive a one-camera world: refused, naming both."""
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.models import build_model

    pipeline = load_pipeline(overrides=[*SMALL, f"data.root={shards}", "data.rig.cameras=[{name: front}]"])
    path = save_model_checkpoint(tmp_path / "model.pt", pipeline, build_model(pipeline).state_dict())
    code, err = cli("drive", str(path), "--policy", "network", "--episodes", "1", f"drive.out_dir={tmp_path / 'd'}")
    assert code == 2 and "Traceback" not in err, err
    assert (f"checkpoint {path} was trained on data recorded with cameras ['front', 'front_left', 'front_right', "
            "'back', 'back_left', 'back_right'] at image size [32, 64] (height, width), but its rig (data.rig) is "
            "['front'] at [32, 64]") in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("member, array, found", [
    ("intrinsics", np.zeros((6, 3), np.float32), "found float32 (6, 3)"),
    ("intrinsics", np.tile(np.eye(3, dtype=np.float32), (5, 1, 1)), "found float32 (5, 3, 3)"),
    ("cam_to_ego", np.zeros((6, 4, 3), np.float32), "found float32 (6, 4, 3)"),
    ("intrinsics", np.full((6, 3, 3), np.nan, np.float32), "expected finite numbers, found nan"),
], ids=["intrinsics-2d", "intrinsics-5-cameras", "cam-to-ego-4x3", "intrinsics-nan"])
def test_stored_cameras_of_the_wrong_shape_are_named_by_train_and_eval(shards, tmp_path, member, array, found):
    """The rig check reads the first sample's stored cameras: a member of another shape was an IndexError there."""
    import shutil

    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.data.format import npy_bytes
    from stack.models import build_model
    from tests.data.test_bad_input import _rewrite

    root = tmp_path / "data"
    shutil.copytree(shards, root)
    manifest = json.loads((root / "manifest.json").read_text())
    shard = root / manifest["splits"]["train"][0]["path"]
    _rewrite(shard, lambda name, data: npy_bytes(array) if name.endswith(f".{member}.npy") else data)
    code, err = cli("train", *SMALL, f"data.root={root}", f"train.out_dir={tmp_path / 'out'}")
    last = err.strip().splitlines()[-1]  # after the line on train.precision this CPU picks
    assert code == 2 and "Traceback" not in err and last.startswith("stack train: error:"), err
    assert str(shard) in last and f"member {member}.npy" in last and found in last and "stack data make" in last, err
    assert not (tmp_path / "out").exists()
    pipeline = load_pipeline(overrides=[*SMALL, f"data.root={root}"])
    path = save_model_checkpoint(tmp_path / "model.pt", pipeline, build_model(pipeline).state_dict())
    code, err = cli("eval", str(path), "--split", "train")
    assert code == 2 and "Traceback" not in err and f"member {member}.npy" in err and found in err, err
