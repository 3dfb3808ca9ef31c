"""The checkpoint contract: plain and Lightning formats, atomic writes, and every bad-input error."""

import pytest
import torch

from stack.checkpoint.model_file import (CheckpointError, check_same_network, load_for_deploy, load_model_checkpoint,
                              save_model_checkpoint)
from stack.config import load_pipeline, pipeline_hash, pipeline_to_yaml
from stack.lineage import dataset_fingerprint

TINY = ["configs/pipeline.yaml", "configs/presets/tiny.yaml"]


@pytest.fixture(scope="module")
def tiny():
    return load_pipeline(TINY)


def test_plain_round_trip_is_atomic(tmp_path, tiny):
    state = {"conv.weight": torch.randn(4, 3, 3, 3)}
    path = save_model_checkpoint(tmp_path / "m.pt", tiny, state, extra={"step": 7})
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]  # no temp file left behind
    pipeline, loaded, meta = load_model_checkpoint(path)
    assert pipeline == tiny
    assert torch.equal(loaded["conv.weight"], state["conv.weight"])
    lineage = {"dataset": dataset_fingerprint(tiny.data.root), "tracking": None}  # stack.lineage; no run active
    assert meta == {"pipeline_hash": pipeline_hash(tiny), "format": "stack-model", "extra": {"step": 7}, **lineage}


def test_lightning_checkpoint_strips_model_prefix(tmp_path, tiny):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model.head.bias": torch.ones(2), "ema.x": torch.zeros(1)}, "epoch": 3,
                "hyper_parameters": {"pipeline_yaml": pipeline_to_yaml(tiny), "pipeline_hash": "abc"}}, path)
    pipeline, state, meta = load_model_checkpoint(path)
    assert pipeline.name == "tiny" and list(state) == ["head.bias"]
    assert meta["format"] == "lightning" and meta["extra"] == {"epoch": 3}


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_checkpoint(tmp_path / "nope.ckpt")


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "junk.ckpt"
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_model_checkpoint(path)
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="expected a dict with a 'state_dict'"):
        load_model_checkpoint(path)


def test_checkpoint_without_pipeline(tmp_path):
    path = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(CheckpointError, match="carries no pipeline"):
        load_model_checkpoint(path)


def test_checkpoint_of_another_schema_version(tmp_path, tiny):
    from stack.pipeline import SCHEMA_VERSION

    path = tmp_path / "old.ckpt"
    text = pipeline_to_yaml(tiny).replace(f"schema_version: {SCHEMA_VERSION}", "schema_version: 0")
    torch.save({"state_dict": {}, "pipeline_yaml": text}, path)
    with pytest.raises(CheckpointError, match="schema 0; this stack reads schemas 1, 2, 3"):
        load_model_checkpoint(path)


def test_a_schema_2_checkpoint_loads_with_a_removed_key_off_and_is_refused_with_it_set(tmp_path, tiny):
    """Schema 3 removed model.planning_stop_deceleration: a schema-2 checkpoint that trained without it (0) loads as
    the same network; one that trained with it is refused, saying why the key went and what to do."""
    from stack.errors import ConfigError
    from stack.pipeline import SCHEMA_VERSION

    text = pipeline_to_yaml(tiny).replace(f"schema_version: {SCHEMA_VERSION}", "schema_version: 2")
    for value, name in ((0.0, "off.pt"), (3.5, "on.pt")):
        stored = text.replace("\nmodel:\n", f"\nmodel:\n  planning_stop_deceleration: {value}\n", 1)
        torch.save({"format": "stack-model", "schema_version": 2, "pipeline_yaml": stored, "state_dict": {}},
                   tmp_path / name)
    pipeline, _, _ = load_model_checkpoint(tmp_path / "off.pt")
    assert pipeline == tiny
    with pytest.raises(ConfigError, match="planning_stop_deceleration: 3.5. It was removed in pipeline schema 3.*"
                                          "2026-11-27_plan-guard.md.*Drop the key"):
        load_model_checkpoint(tmp_path / "on.pt")


def test_checkpoint_from_another_pipeline(tmp_path, tiny):
    path = save_model_checkpoint(tmp_path / "m.pt", tiny, {})
    default = load_pipeline(["configs/pipeline.yaml"])
    with pytest.raises(CheckpointError, match=f"model.backbone: checkpoint has '{tiny.model.backbone}'"):
        check_same_network(tiny, default, path)
    with pytest.raises(CheckpointError, match="another pipeline"):
        load_for_deploy(path, ["configs/pipeline.yaml"], [])
    # deploy-only keys may differ; with no files the checkpoint's own pipeline is used
    pipeline, _, _ = load_for_deploy(path, TINY, ["export.opset=18", "targets.orin.min_fps=30"])
    assert pipeline.export.opset == 18 and pipeline.targets["orin"].min_fps == 30
    pipeline, _, _ = load_for_deploy(path, [], ["export.opset=18"])
    assert pipeline.model == tiny.model and pipeline.export.opset == 18


def test_weights_of_another_shape_are_named_not_a_traceback():
    import torch

    from stack.config import load_pipeline
    from stack.deploy.exportable import export_network
    from stack.errors import StackError
    from stack.models import build_model

    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])
    weights = build_model(pipeline).state_dict()
    name = next(k for k, v in weights.items() if v.ndim == 4)
    weights[name] = torch.zeros(1, *weights[name].shape[1:])
    with pytest.raises(StackError, match="1 of another shape") as caught:
        export_network(pipeline, weights)
    assert name in str(caught.value)
