"""A bundle is built for one camera calibration: export bakes it, deploy and the runtime refuse any other.

A small real BevNet (128x64 images, 32x32 BEV cells) keeps each export to a few seconds;
the converted-dataset tests write the nuScenes-format fixture of tests/data/test_convert.py.
"""

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from stack.cli import main
from stack.config import load_pipeline
from stack.deploy.calibration import Calibration, CalibrationMismatch, check_samples
from stack.errors import StackError

REPO = Path(__file__).resolve().parents[2]
MICRO = ["data.rig.image_width=128", "data.rig.image_height=64", "model.bev.x_range=[-16.0,16.0]",
         "model.bev.y_range=[-16.0,16.0]", "model.depth.bins=16", "model.neck_channels=16", "model.bev_channels=16",
         "data.samples_per_shard=2", "data.batch_size=1", "data.num_workers=0"]
FILES = [str(REPO / "configs/pipeline.yaml"), str(REPO / "configs/presets/tiny.yaml")]


def micro_pipeline(*extra):
    return load_pipeline(FILES, [*MICRO, *extra])


def moved(calibration: Calibration, roll_deg: float = 1.5) -> Calibration:
    """The rig's cameras moved by 3-5 cm, yawed/pitched by 1-2° (Camera fields), then rolled about the optical axis."""
    pipeline = micro_pipeline()
    cameras = [dataclasses.replace(c, x=c.x + 0.03, y=c.y - 0.04, z=c.z + 0.05, yaw_deg=c.yaw_deg + 1.5,
                                   pitch_deg=c.pitch_deg + 1.0) for c in pipeline.data.rig.cameras]
    rig = dataclasses.replace(pipeline.data.rig, cameras=cameras)
    result = Calibration.from_rig(rig)
    angle = math.radians(roll_deg)
    roll = np.array([[math.cos(angle), -math.sin(angle), 0], [math.sin(angle), math.cos(angle), 0], [0, 0, 1]])
    poses = result.cam_to_ego.copy()
    poses[:, :3, :3] = poses[:, :3, :3] @ roll  # rotate about the camera's z (optical) axis
    return Calibration(result.image_width, result.image_height, result.cameras, result.intrinsics, poses, "moved")


@pytest.fixture(scope="module")
def micro():
    """(pipeline, state_dict of an untrained micro BevNet)."""
    from stack.models import build_model

    pipeline = micro_pipeline()
    torch.manual_seed(0)
    return pipeline, build_model(pipeline).state_dict()


def export(pipeline, state_dict, calibration, path):
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network

    network = export_network(pipeline, state_dict, calibration)
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    return network


def frames(pipeline, count=2, seed=0):
    rng = np.random.default_rng(seed)
    rig = pipeline.data.rig
    return [{"images": rng.integers(0, 256, (1, len(rig.cameras), 3, rig.image_height, rig.image_width), dtype=np.uint8),
             "ego_status": np.array([[rng.uniform(2, 12), 0.3, 0.05]], np.float32),
             "command": np.array([1], np.int64)} for _ in range(count)]


def per_call_outputs(pipeline, state_dict, calibration, feeds):
    """PyTorch with geometry computed per call from `calibration` (what training does): the reference."""
    from stack.models import build_model

    net = build_model(pipeline)
    net.load_state_dict(state_dict)
    net.eval()
    ks = torch.as_tensor(calibration.intrinsics, dtype=torch.float32)[None]
    poses = torch.as_tensor(calibration.cam_to_ego, dtype=torch.float32)[None]
    with torch.no_grad():
        return net(*(torch.from_numpy(feeds[k]) for k in ("images", "ego_status", "command")),
                   geometry=net.geometry(ks, poses))


@pytest.fixture(scope="module")
def exported(micro, tmp_path_factory):
    """{"nominal"|"moved": (onnx path, Calibration)} for the micro network."""
    pipeline, state_dict = micro
    folder = tmp_path_factory.mktemp("calibrated")
    nominal = Calibration.from_rig(pipeline.data.rig)
    out = {}
    for name, calibration in (("nominal", nominal), ("moved", moved(nominal))):
        export(pipeline, state_dict, calibration, folder / f"{name}.onnx")
        out[name] = (folder / f"{name}.onnx", calibration)
    return out


# ----------------------------------------------------------------------------- the calibration itself

def test_file_round_trip_hash_and_differences(tmp_path):
    nominal = Calibration.from_rig(micro_pipeline().data.rig)
    for suffix in ("yaml", "json"):
        again = Calibration.load(nominal.save(tmp_path / f"c.{suffix}"))
        assert again.hash == nominal.hash and again.compare(nominal) == []
    float32 = Calibration(128, 64, nominal.cameras, nominal.intrinsics.astype(np.float32),
                          nominal.cam_to_ego.astype(np.float32))
    assert float32.compare(nominal) == []  # shards store float32: still the same calibration
    differences = nominal.compare(moved(nominal))
    assert len(differences) == 6
    assert differences[0].startswith("camera front: position differs by 7.1 cm, rotation by ")
    angle = float(differences[0].split("rotation by ")[1].split("°")[0])
    assert 1.5 < angle < 3.0


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["cameras"][0]["cam_to_ego"][0].__setitem__(0, 2.0), "not a proper rotation"),
    (lambda d: d["cameras"][1]["intrinsics"][0].__setitem__(0, float("nan")), "non-finite"),
    (lambda d: d["cameras"][2]["intrinsics"][0].__setitem__(2, 900.0), "principal point"),
    (lambda d: d["cameras"].pop(), "hash"),
    (lambda d: d.pop("cameras"), "cameras"),
])
def test_malformed_files_are_refused(tmp_path, edit, needle):
    data = Calibration.from_rig(micro_pipeline().data.rig).to_dict()
    edit(data)
    if needle != "hash":
        data.pop("hash", None)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(StackError, match=needle):
        Calibration.load(path)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", None], ids=["not-utf8", "a-folder"])
def test_unreadable_calibration_files_are_refused(tmp_path, content):
    path = tmp_path / "vehicle.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(StackError, match="calibration file"):
        Calibration.load(path)


@pytest.mark.parametrize("content, needle", [
    ("[" * 200_000 + "]" * 200_000, "nested more than 64 levels deep"),
    ('{"format": "stack-calibration/1", "image_width": 1e999}', "the number 1e999"),
    ('{"format": "stack-calibration/1", "image_width": Infinity}', "the number Infinity"),
    ("[1, 2]", "found a JSON array"),
    (None, "holds 2,097,152 bytes"),
])
def test_a_hostile_json_calibration_is_refused_before_it_is_used(tmp_path, content, needle):
    """A .json calibration goes through the bounded reader: too deep, too large a number, too large a file are
    one StackError naming the file and how to write a good one."""
    path = tmp_path / "vehicle.json"
    if content is None:
        with path.open("wb") as handle:
            handle.truncate(2 * 1024 * 1024)
    else:
        path.write_text(content)
    with pytest.raises(StackError) as caught:
        Calibration.load(path)
    message = str(caught.value)
    assert needle in message and "stack data calibration" in message and "\n" not in message, message


def test_an_alias_bomb_calibration_is_refused_before_it_expands(tmp_path):
    """Nine anchors of nine aliases each are 387 million numbers once expanded: refused unread, in well under
    a second, instead of filling memory in np.array."""
    import time

    anchors = [f"- &a0 [{', '.join(['1.0'] * 9)}]"]
    anchors += [f"- &a{level} [{', '.join([f'*a{level - 1}'] * 9)}]" for level in range(1, 9)]
    path = tmp_path / "vehicle.yaml"
    path.write_text("anchors:\n" + "\n".join(f"  {line}" for line in anchors) + "\n"
                    "image_width: 128\nimage_height: 64\ncameras:\n- {name: front, intrinsics: *a8, cam_to_ego: *a8}\n")
    start = time.monotonic()
    with pytest.raises(StackError, match=r"calibration file .* expands to more than 10,000 values.*alias bomb.*"
                                         r"stack data calibration"):
        Calibration.load(path)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("value, found", [(".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan"), ("1.0e+400", "inf"),
                                          ("128.5", "128.5"), ("true", "True"), ("wide", "'wide'"),
                                          ("100000", "100000"), ("[128]", "[128]")])
def test_an_image_size_that_is_not_a_pixel_count_is_refused(tmp_path, value, found):
    """`image_width: .inf` escaped as an OverflowError from int(); 128.5 was read as 128 without a word."""
    text = Calibration.from_rig(micro_pipeline().data.rig).to_yaml()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("hash:"))
    path = tmp_path / "vehicle.yaml"
    path.write_text(text.replace("image_width: 128", f"image_width: {value}"))
    with pytest.raises(StackError, match=rf"calibration file .*vehicle.yaml: image_width is {re.escape(found)}, "
                                         rf"expected a whole number of pixels from 1 to 8192"):
        Calibration.load(path)


def test_deploy_refuses_an_infinite_image_width_in_one_line(micro, tmp_path, capsys):
    from stack.checkpoint.model_file import save_model_checkpoint

    pipeline, state_dict = micro
    checkpoint = save_model_checkpoint(tmp_path / "model.pt", pipeline, state_dict)
    path = tmp_path / "vehicle.json"
    data = Calibration.from_rig(pipeline.data.rig).to_dict()
    data.pop("hash")
    path.write_text(json.dumps({**data, "image_width": float("inf")}))  # JSON's Infinity
    code = main(["deploy", "--target", "cpu", str(checkpoint), "--calibration", str(path),
                 f"export.out_dir={tmp_path / 'bundles'}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "found the number Infinity" in err, err
    assert not (tmp_path / "bundles").exists()


@pytest.mark.parametrize("where", ["a-folder", "under-a-file"])
def test_saving_a_calibration_to_a_folder_or_under_a_file_is_refused(tmp_path, where, capsys):
    nominal = Calibration.from_rig(micro_pipeline().data.rig)
    if where == "a-folder":
        path = tmp_path / "vehicle.yaml"
        path.mkdir()
        (path / "mine.txt").write_text("mine")
        needle = "is a folder"
    else:
        (tmp_path / "notes").write_text("mine")
        path, needle = tmp_path / "notes" / "vehicle.yaml", "lies under .*notes.*, which is a file"
    with pytest.raises(StackError, match=rf"calibration file {re.escape(str(path))} {needle}.*--out"):
        nominal.save(path)
    # `stack data calibration --out` says so before it reads the dataset (here: none)
    assert main(["data", "calibration", str(tmp_path / "no-dataset"), "--out", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(needle, err), err
    assert (tmp_path / "vehicle.yaml" / "mine.txt").read_text() == "mine" if where == "a-folder" else \
        (tmp_path / "notes").read_text() == "mine"


def test_wrong_camera_count_or_size_does_not_fit_the_network():
    pipeline = micro_pipeline()
    nominal = Calibration.from_rig(pipeline.data.rig)
    five = Calibration(128, 64, nominal.cameras[:5], nominal.intrinsics[:5], nominal.cam_to_ego[:5], "five")
    with pytest.raises(CalibrationMismatch, match="the network takes cameras"):
        five.check_fits(pipeline.data.rig)
    doubled = nominal.intrinsics.copy()
    doubled[:, :2] *= 2
    with pytest.raises(CalibrationMismatch, match="at 128x64"):
        Calibration(256, 128, nominal.cameras, doubled, nominal.cam_to_ego).check_fits(pipeline.data.rig)


# ----------------------------------------------------------------------------- export bakes the calibration

def test_exported_network_pools_with_the_calibration_it_was_built_for(micro, exported):
    """ORT of the network built for the moved rig = PyTorch with that rig's geometry; the nominal one is not."""
    from stack.deploy.export import read_metadata
    from stack.deploy.runtime import ort_session

    pipeline, state_dict = micro
    path, calibration = exported["moved"]
    feeds = frames(pipeline)
    sessions = {name: ort_session(exported[name][0]) for name in ("moved", "nominal")}
    bev_outputs = ("heatmap", "box_regression", "plan_trajectories")
    for sample in feeds:
        reference = per_call_outputs(pipeline, state_dict, calibration, sample)
        for name, session in sessions.items():
            got = dict(zip(reference, session.run(list(reference), sample)))
            for output in bev_outputs:
                expected = reference[output].numpy()
                tolerance = pipeline.export.parity_atol + pipeline.export.parity_rtol * np.abs(expected).max()
                error = np.abs(got[output] - expected).max()
                if name == "moved":
                    assert error <= tolerance, (output, error, tolerance)
                elif output == "heatmap":
                    assert error > 20 * tolerance, (output, error, tolerance)  # baked nominal pools elsewhere
    meta = read_metadata(path)
    assert meta["calibration_hash"] == calibration.hash != exported["nominal"][1].hash
    assert Calibration.from_dict(meta["calibration"]).compare(calibration) == []


def test_parity_reference_is_the_training_path_of_the_calibration(micro, exported):
    """Export parity's reference pools with bev_pool per call: it accepts the graph built for its calibration
    and rejects one built for another (baked against baked would accept both)."""
    from stack.deploy.export import check_parity
    from stack.deploy.exportable import training_path_network

    pipeline, state_dict = micro
    feeds = frames(pipeline, 1, seed=7)
    names = ["heatmap", "box_regression", "plan_trajectories", "plan_scores"]
    reference = training_path_network(pipeline, state_dict, exported["moved"][1])
    cfg = pipeline.export
    assert all(r.passed for r in check_parity(reference, exported["moved"][0], feeds, names, cfg.parity_atol, cfg.parity_rtol))
    wrong = check_parity(reference, exported["nominal"][0], feeds, names, cfg.parity_atol, cfg.parity_rtol)
    assert not next(r for r in wrong if r.output == "heatmap").passed


def test_a_camera_aware_network_is_exported_with_the_camera_of_its_calibration(tmp_path):
    """model.depth.camera_aware: the depth head's camera vector is baked from the calibration the bundle is built
    for, as the pooling is: ORT of the graph built for the moved rig = PyTorch given that rig's cameras."""
    from stack.deploy.runtime import ort_session
    from stack.models import build_model

    pipeline = micro_pipeline("model.depth.camera_aware=true")
    torch.manual_seed(0)
    net = build_model(pipeline)
    with torch.no_grad():
        net.depth_head.camera_gates.gates.weight.normal_(std=1.0)  # gates that depend on the camera
    state_dict = net.state_dict()
    nominal = Calibration.from_rig(pipeline.data.rig)
    calibration = moved(nominal)
    export(pipeline, state_dict, calibration, tmp_path / "aware.onnx")
    session = ort_session(tmp_path / "aware.onnx")
    for sample in frames(pipeline, 1, seed=3):
        reference = per_call_outputs(pipeline, state_dict, calibration, sample)
        got = dict(zip(reference, session.run(list(reference), sample)))
        for output in ("depth_logits", "heatmap"):
            expected = reference[output].numpy()
            tolerance = pipeline.export.parity_atol + pipeline.export.parity_rtol * np.abs(expected).max()
            assert np.abs(got[output] - expected).max() <= tolerance, output
        other = per_call_outputs(pipeline, state_dict, nominal, sample)["depth_logits"].numpy()
        tolerance = pipeline.export.parity_atol + pipeline.export.parity_rtol * np.abs(other).max()
        assert np.abs(got["depth_logits"] - other).max() > 2 * tolerance, "the nominal camera's depth is another"


# ----------------------------------------------------------------------------- the runtime interface

def write_bundle(folder: Path, onnx_path: Path, calibration: Calibration, shipped: str = "model.onnx") -> Path:
    """A bundle as deploy writes it for an fp32 ONNX Runtime target (model, calibration.yaml, gate.json vouching for
    every file, with figures its verdicts follow from)."""
    import shutil

    from deploy_fixture_net import drives, heads_like_the_recipe

    from stack.deploy.bundle import vouch
    from stack.deploy.gates.quality import driving_quality, head_quality, quality_verdict
    from stack.deploy.report import write_gate_json
    from stack.pipeline import ClosedLoopBudget

    folder.mkdir(parents=True)
    shutil.copyfile(onnx_path, folder / "model.onnx")
    (folder / "calibration.yaml").write_text(calibration.to_yaml())
    timing = {"median_ms": 10.0, "p99_ms": 12.0, "mean_ms": 10.5, "runs": 20}
    result = {"target": "cpu", "runtime": "onnxruntime", "precision": "fp32", "passed": True, "failures": [],
              "export": {"parity": [], "tensorrt_problems": []}, "accuracy": None, "closed_loop": None,
              "shipped": {"file": shipped, "precision": "fp32", "why": "test"},
              "fps": {"median_ms": 10.0, "p99_ms": 12.0, "raw_median_ms": 10.0, "raw_p99_ms": 12.0, "scale": 1.0,
                      "min_fps": 10.0, "max_p99_ms": 100.0, "passed": True},
              "speed": {"side_by_side": {"model.onnx": timing}}}
    closed_loop = drives(0.2)(None, folder / "model.onnx", ClosedLoopBudget(), 50.0, print)  # a network that drives
    quality = quality_verdict(head_quality(heads_like_the_recipe(None), "test"), driving_quality(closed_loop))
    result.update(closed_loop=closed_loop, quality=quality, allow_below_bar=False, below_bar=[], for_deployment=True)
    write_gate_json(folder, vouch(folder, result))
    return folder


def test_deployed_network_refuses_another_calibration(micro, exported, tmp_path):
    from stack.deploy.runner import DeployedNetwork
    from stack.deploy.runtime import ort_session

    pipeline, _ = micro
    path, calibration = exported["moved"]
    bundle = write_bundle(tmp_path / "bundle", path, calibration)
    net = DeployedNetwork.open(bundle)
    assert net.path.name == "model.onnx" and net.calibration.hash == calibration.hash
    sample = frames(pipeline, 1, seed=3)[0]
    outputs = net.infer(sample["images"], sample["ego_status"], sample["command"], calibration)
    direct = ort_session(path).run(net.output_names, sample)
    for name, value in zip(net.output_names, direct):
        np.testing.assert_allclose(outputs[name], value, rtol=1e-5, atol=1e-5)
    nominal = exported["nominal"][1]
    with pytest.raises(CalibrationMismatch, match=r"camera front: position differs by 7\.1 cm"):
        net.infer(sample["images"], sample["ego_status"], sample["command"], nominal)
    with pytest.raises(StackError, match="'ego_status': expected a numpy float32"):
        net.infer(sample["images"], sample["ego_status"].astype(np.float64), sample["command"], calibration)
    with pytest.raises(StackError, match="has no model.int8.onnx"):
        DeployedNetwork.open(bundle, model="int8")


def test_deployed_network_opens_the_shipped_model(exported, tmp_path):
    from stack.deploy.runner import DeployedNetwork

    path, calibration = exported["moved"]
    assert DeployedNetwork.open(write_bundle(tmp_path / "a", path, calibration, shipped="model.onnx")).path.name \
        == "model.onnx"
    with pytest.raises(StackError, match=r"ships '\.\./model\.onnx'; expected one of the bundle's own model files"):
        DeployedNetwork.open(write_bundle(tmp_path / "b", path, calibration, shipped="../model.onnx"))
    with pytest.raises(StackError, match="model='fp16'"):
        DeployedNetwork.open(tmp_path / "a", model="fp16")


def test_deployed_network_refuses_a_bundle_whose_calibration_was_swapped(exported, tmp_path):
    from stack.deploy.bundle import BundleMismatch
    from stack.deploy.runner import DeployedNetwork

    path, calibration = exported["moved"]
    bundle = write_bundle(tmp_path / "bundle", path, calibration, shipped="model.onnx")
    (bundle / "calibration.yaml").write_text(exported["nominal"][1].to_yaml())
    with pytest.raises(BundleMismatch, match="calibration.yaml: changed"):
        DeployedNetwork.open(bundle)
    # a bundle assembled from two builds (gate re-vouched, but model and calibration disagree)
    mixed = write_bundle(tmp_path / "mixed", path, exported["nominal"][1])
    with pytest.raises(CalibrationMismatch, match="mixes files of two builds"):
        DeployedNetwork.open(mixed)


# ----------------------------------------------------------------------------- deploy on a converted dataset

def _convert_fixture():
    spec = importlib.util.spec_from_file_location("convert_fixture", REPO / "tests/data/test_convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # skips the test when nuscenes-devkit is absent
    return module


@pytest.fixture(scope="module")
def converted(micro, tmp_path_factory):
    """(checkpoint, data root) of the micro network and a converted nuScenes-format dataset."""
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.data.convert import convert

    fixture = _convert_fixture()
    folder = tmp_path_factory.mktemp("nuscenes")
    pipeline = micro_pipeline(f"data.root={folder / 'shards'}", f"export.out_dir={folder / 'export'}",
                              "export.calibration_samples=1", "export.accuracy_samples=1", "export.sensitivity_samples=1")
    fixture.write_fixture(folder / "source", pipeline.data.rig)
    convert(pipeline, "nuscenes", str(folder / "source"), "v1.0-mini")
    checkpoint = save_model_checkpoint(folder / "micro.pt", pipeline, micro[1])
    return checkpoint, folder


def test_deploy_refuses_samples_recorded_with_another_calibration(converted, capsys):
    """Converted nuScenes intrinsics are not the nominal rig's: deploy must say so, not gate on mis-pooled frames."""
    checkpoint, folder = converted
    code = main(["deploy", "--target", "ci-cpu", str(checkpoint)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "sample 0, was recorded with another camera calibration" in err
    assert "camera front: intrinsics by up to" in err and "stack data calibration" in err
    assert not (folder / "export" / "ci-cpu").exists()
    moved_file = moved(Calibration.from_rig(micro_pipeline().data.rig)).save(folder / "moved.yaml")
    code = main(["export", str(checkpoint), "--calibration", str(moved_file)])
    err = capsys.readouterr().err
    assert code == 2 and "position differs by 7.1 cm" in err and "rotation by" in err, err


def test_converted_dataset_deploys_with_its_own_calibration(converted, capsys):
    """`stack data calibration` extracts it; export bakes it, parity holds, every sample is accepted."""
    from stack.deploy.export import read_metadata
    from stack.deploy.validation import calibration_and_accuracy

    checkpoint, folder = converted
    written = folder / "vehicle.yaml"
    assert main(["data", "calibration", str(folder / "shards"), "--out", str(written)]) == 0
    vehicle = Calibration.load(written)
    np.testing.assert_allclose(vehicle.intrinsics[0, 0, 0], 253.2 * 128 / 320, rtol=1e-6)
    code = main(["export", str(checkpoint), "--calibration", str(written)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" ok") == 7 and "FAIL" not in out  # seven named outputs, the attribute logits among them
    assert read_metadata(folder / "export" / "model.onnx")["calibration_hash"] == vehicle.hash
    assert Calibration.load(folder / "export" / "calibration.yaml").hash == vehicle.hash
    pipeline = micro_pipeline(f"data.root={folder / 'shards'}", "export.calibration_samples=1", "export.sensitivity_samples=1",
                              "export.accuracy_samples=1")
    calibration_split, accuracy, _ = calibration_and_accuracy(pipeline)
    check_samples(calibration_split + accuracy, vehicle, "converted samples")  # accepted: no error


def test_data_calibration_refuses_a_dataset_of_two_vehicles(converted, tmp_path):
    """Two shards recorded with different calibrations: no single calibration to build a bundle for."""
    import shutil

    from stack.deploy.calibration import dataset_calibration

    _, folder = converted
    root = tmp_path / "two"
    shutil.copytree(folder / "shards", root)
    manifest = json.loads((root / "manifest.json").read_text())
    train = root / manifest["splits"]["train"][0]["path"]
    _rewrite_intrinsics(train, scale=1.1)
    with pytest.raises(CalibrationMismatch, match="more than one camera calibration"):
        dataset_calibration(str(root))
    assert dataset_calibration(str(train), sample=0).intrinsics[0, 0, 0] == pytest.approx(253.2 * 128 / 320 * 1.1, 1e-5)


def _rewrite_intrinsics(shard: Path, scale: float) -> None:
    """Rewrite every intrinsics.npy of `shard` scaled (a second vehicle with longer lenses)."""
    import io
    import tarfile

    members = []
    with tarfile.open(shard) as tar:
        for member in tar:
            data = tar.extractfile(member).read()
            if member.name.endswith(".intrinsics.npy"):
                k = np.load(io.BytesIO(data))
                k[:, :2, :] *= scale
                buffer = io.BytesIO()
                np.save(buffer, k)
                data = buffer.getvalue()
                member.size = len(data)
            members.append((member, data))
    with tarfile.open(shard, "w") as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))


@pytest.mark.slow
def test_converted_dataset_bundle_runs_through_the_deployed_network(converted, capsys):
    """The whole deploy path on converted data with its own calibration, then the runtime interface on the bundle."""
    from stack.deploy.runner import DeployedNetwork
    from stack.deploy.validation import load_validation

    checkpoint, folder = converted
    written = folder / "vehicle-full.yaml"
    assert main(["data", "calibration", str(folder / "shards"), "--out", str(written)]) == 0
    code = main(["deploy", "--target", "ci-cpu", str(checkpoint), "--calibration", str(written),
                 "export.timing_runs=20", "export.timing_warmup=1", "targets.ci-cpu.closed_loop.episodes=0"])
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err  # the gates may pass or fail on an untrained network; the input is good
    vehicle = Calibration.load(written)
    net = DeployedNetwork.open(folder / "export" / "ci-cpu", allow_below_bar=True)  # untrained: below the bar
    assert net.calibration.hash == vehicle.hash and net.metadata["calibration_hash"] == vehicle.hash
    gate = json.loads((folder / "export" / "ci-cpu" / "gate.json").read_text())
    assert gate["camera_calibration"]["hash"] == vehicle.hash
    assert f"hash {vehicle.hash[:16]}" in (folder / "export" / "ci-cpu" / "report.md").read_text()
    pipeline = micro_pipeline(f"data.root={folder / 'shards'}")
    batch = load_validation(pipeline, 1)[0][0]
    outputs = net.infer(batch.images.numpy(), batch.ego_status.numpy(), batch.command.numpy(),
                        Calibration.from_batch(batch, 0, vehicle.cameras))
    assert set(outputs) == set(net.output_names) and all(np.isfinite(v).all() for v in outputs.values())
    with pytest.raises(CalibrationMismatch, match="intrinsics by up to"):
        net.infer(batch.images.numpy(), batch.ego_status.numpy(), batch.command.numpy(),
                  Calibration.from_rig(pipeline.data.rig))


@pytest.mark.slow  # a whole `stack deploy` with two closed-loop episodes of five policies (~1-2 min on 2 cores)
def test_a_per_vehicle_bundle_that_drives_badly_is_refused_end_to_end(converted, micro, capsys):
    """`stack deploy --calibration` as a user runs it for one car: the bundle is built for the car's cameras, the
    closed-loop gate renders those cameras and drives the bundle, and a network whose planner drifts left (as a
    bad scale would shift it) is refused on its driving, not waved through because it was built per vehicle."""
    from stack.checkpoint.model_file import save_model_checkpoint

    _, folder = converted
    written = folder / "vehicle-e2e.yaml"
    assert main(["data", "calibration", str(folder / "shards"), "--out", str(written)]) == 0
    vehicle = Calibration.load(written)
    pipeline = micro_pipeline(f"data.root={folder / 'shards'}", f"export.out_dir={folder / 'export-e2e'}",
                              "export.calibration_samples=1", "export.accuracy_samples=1", "export.sensitivity_samples=1",
                              "drive.seeds=[0]", "drive.scenarios=[lead_brake,route]")
    state = dict(micro[1])
    bias = torch.zeros_like(state["planning_head.waypoints.bias"]).view(-1, 2)
    bias[:, 1] = 0.4  # metres to the left per 0.5 s step, accumulated by the head's cumsum
    state["planning_head.waypoints.bias"] = bias.view(-1)
    checkpoint = save_model_checkpoint(folder / "drifting.pt", pipeline, state)
    capsys.readouterr()
    code = main(["deploy", "--target", "orin", str(checkpoint), "--calibration", str(written),
                 "targets.orin.closed_loop.episodes=2"])
    out = capsys.readouterr().out
    assert code == 1, out[-3000:]
    assert "quality: closed loop: the network does not beat" in out, out[-3000:]
    gate = json.loads((folder / "export-e2e" / "orin" / "gate.json").read_text())
    cameras = gate["closed_loop"]["cameras"]
    assert cameras["rendered"] == "the bundle's own calibration" and cameras["hash"] == vehicle.hash, cameras
    assert gate["closed_loop"]["episodes"] == 2 and not gate["for_deployment"] and not gate["passed"]
