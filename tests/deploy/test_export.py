"""Export: named outputs, metadata, full checker, ONNX Runtime parity with PyTorch, op checks."""

import onnx
import pytest
from onnx import helper

from stack.deploy.export import check_parity, read_metadata
from stack.deploy.trt_ops import SUPPORTED, tensorrt_problems

from deploy_fixture_net import make_samples


def test_hostile_metadata_is_refused_and_plain_text_stays_text(fixture_onnx, tmp_path):
    """ONNX metadata is read with the bounded JSON reader: a structure nested past its limit is a StackError
    naming the key, not a RecursionError; a value that is plain text stays text."""
    import pytest

    from stack.deploy.export import set_metadata
    from stack.errors import StackError

    path, _ = fixture_onnx
    model = onnx.load(str(path))
    set_metadata(model, {"note": "trained on rendered scenes", "deep": "[" * 50_000 + "]" * 50_000})
    edited = tmp_path / "edited.onnx"
    onnx.save(model, str(edited))
    with pytest.raises(StackError, match="metadata 'deep': expected a JSON value; found JSON nested more than 64"):
        read_metadata(edited)
    set_metadata(model, {"note": "trained on rendered scenes", "count": 3})
    onnx.save(model, str(edited))
    assert read_metadata(edited) == {"note": "trained on rendered scenes", "count": 3}


def test_export_names_outputs_and_carries_metadata(fixture_onnx):
    path, _ = fixture_onnx
    model = onnx.load(str(path))
    assert [o.name for o in model.graph.output] == ["segmentation", "speed"]
    assert [i.name for i in model.graph.input] == ["images", "ego_speed"]
    assert read_metadata(path) == {"pipeline_hash": "x"}
    assert not any(n.op_type == "BatchNormalization" for n in model.graph.node)  # folded into conv
    assert {n.op_type for n in model.graph.node} <= SUPPORTED


def test_onnxruntime_matches_pytorch_per_output(fixture_onnx):
    path, net = fixture_onnx
    rows = check_parity(net, path, make_samples(4, seed=5), ["segmentation", "speed"], atol=1e-4)
    assert [r.output for r in rows] == ["segmentation", "speed"]
    assert all(r.passed for r in rows), rows
    assert all(r.max_abs_value > 0 for r in rows)


def test_parity_catches_a_different_network(fixture_onnx):
    from deploy_fixture_net import make_net

    path, _ = fixture_onnx
    rows = check_parity(make_net(seed=3), path, make_samples(2), ["segmentation", "speed"], atol=1e-4)
    assert not all(r.passed for r in rows)


def test_tensorrt_check_flags_scatter_with_reduction():
    node = helper.make_node("ScatterND", ["d", "i", "u"], ["o"], name="pool", reduction="add")
    odd = helper.make_node("NonZero", ["d"], ["n"], name="nz")
    graph = helper.make_graph([node, odd], "g", [], [])
    problems = tensorrt_problems(helper.make_model(graph))
    assert any("reduction" in p and "pool" in p for p in problems)
    assert any(p.startswith("NonZero") for p in problems)



def test_export_folder_must_be_new_empty_or_stacks_own(fixture_onnx, tmp_path):
    """`stack export` writes model.onnx, pipeline.yaml and calibration.yaml into export.out_dir: a folder of
    someone else's files is refused (and left as it was); a previous export or deploy bundles are not."""
    import shutil

    from stack.deploy.entrypoints import check_export_folder
    from stack.errors import StackError

    check_export_folder(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_export_folder(tmp_path / "empty")
    previous = tmp_path / "previous"
    previous.mkdir()
    shutil.copy(fixture_onnx[0], previous / "model.onnx")  # carries a pipeline_hash, as export writes it
    (previous / "pipeline.yaml").write_text("name: tiny\n")
    check_export_folder(previous)
    bundles = tmp_path / "bundles"
    (bundles / "ci-cpu").mkdir(parents=True)
    (bundles / "ci-cpu" / "gate.json").write_text("{}")
    (bundles / ".orin.staging-12345").mkdir()  # left by a killed deploy
    check_export_folder(bundles)
    (bundles / "ci-cpu" / "model.onnx").write_bytes(previous.joinpath("model.onnx").read_bytes())
    for bundle in (bundles / "ci-cpu", bundles / ".orin.staging-12345"):  # a bundle's model.onnx carries a hash too
        with pytest.raises(StackError, match=r"is a deploy bundle .*--verify.*export.out_dir=.*bundles"):
            check_export_folder(bundle)
    assert (bundles / "ci-cpu" / "gate.json").read_text() == "{}"

    (bundles / "notes.txt").write_text("mine")
    with pytest.raises(StackError, match=r"export.out_dir .*bundles is not empty and holds no previous export .*"
                                         r"found 'notes.txt'\. .*Choose an empty or new export.out_dir"):
        check_export_folder(bundles)
    assert (bundles / "notes.txt").read_text() == "mine"
    for name, content in [("garbage", b"\x00not onnx"), ("foreign", None)]:
        folder = tmp_path / name
        folder.mkdir()
        if content is None:  # a real ONNX model, but not one `stack export` wrote (no pipeline hash)
            model = onnx.load(str(fixture_onnx[0]))
            del model.metadata_props[:]
            onnx.save(model, str(folder / "model.onnx"))
        else:
            (folder / "model.onnx").write_bytes(content)
        with pytest.raises(StackError, match="found 'model.onnx'"):
            check_export_folder(folder)
