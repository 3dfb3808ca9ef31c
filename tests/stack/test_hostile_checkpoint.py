"""Hostile checkpoints: a crafted pickle never runs, a bad target name is refused before any file is read,
and a network of another preset is refused by `stack eval` as by export and deploy."""

import contextlib
import io
import os

import pytest
import torch

from stack.checkpoint.model_file import CheckpointError, load_model_checkpoint, save_model_checkpoint
from stack.cli import main
from stack.config import load_pipeline, pipeline_to_yaml

TINY = ["configs/pipeline.yaml", "configs/presets/tiny.yaml"]


class _RunsCode:
    """Unpickling this calls os.system: what a malicious `.pt` file does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def run_cli(*argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.fixture(scope="module")
def tiny():
    return load_pipeline(TINY)


@pytest.fixture
def crafted(tmp_path, tiny):
    """(path of a checkpoint whose pickle would create `marker`, marker)."""
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    torch.save({"format": "stack-model", "schema_version": 1, "pipeline_yaml": pipeline_to_yaml(tiny),
                "state_dict": {}, "extra": {"payload": _RunsCode(marker)}}, path)
    return path, marker


def test_loading_a_crafted_checkpoint_runs_nothing(crafted):
    path, marker = crafted
    with pytest.raises(CheckpointError, match="refused.*weights-only"):
        load_model_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("command", [["export"], ["eval"], ["deploy", "--target", "cpu"], ["drive"]])
def test_every_command_that_reads_a_checkpoint_refuses_it_with_exit_2(crafted, tmp_path, command):
    path, marker = crafted
    code, err = run_cli(*command, str(path), f"export.out_dir={tmp_path / 'export'}")
    assert code == 2, err
    assert "refused" in err and str(path) in err and "Traceback" not in err
    assert not marker.exists()


@pytest.mark.parametrize("target", ["../outside", "a/b", ".hidden", "orin;touch x", "", "x y"])
def test_deploy_checks_the_target_name_before_reading_the_checkpoint(crafted, tmp_path, target):
    path, marker = crafted
    code, err = run_cli("deploy", "--target", target, str(path), f"export.out_dir={tmp_path / 'export'}")
    assert code == 2 and "target name" in err.lower(), err
    assert not marker.exists() and not (tmp_path / "export").exists() and not (tmp_path / "outside").exists()


def test_the_stacks_own_checkpoints_load_weights_only(tmp_path, tiny):
    """model.pt, and a Lightning .ckpt with AdamW, LambdaLR, loop and RNG state as `stack train` writes it."""
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3, foreach=True)
    layer(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    plain = save_model_checkpoint(tmp_path / "model.pt", tiny, layer.state_dict(), extra={"global_step": 3})
    lightning = tmp_path / "step-0000003.ckpt"
    torch.save({"epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.5.0",
                "state_dict": {f"model.{k}": v for k, v in layer.state_dict().items()},
                "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
                "callbacks": {"RollingCheckpoints": {}}, "optimizer_states": [optimizer.state_dict()],
                "lr_schedulers": [schedule.state_dict()], "rng_torch": torch.get_rng_state(),
                "pipeline_yaml": pipeline_to_yaml(tiny), "pipeline_hash": "x"}, lightning)
    for path in (plain, lightning):
        _, state, _ = load_model_checkpoint(path)
        assert torch.equal(state["weight"], layer.weight)


def test_eval_with_another_presets_config_is_refused_up_front(tmp_path, tiny):
    path = save_model_checkpoint(tmp_path / "model.pt", tiny, {})
    code, err = run_cli("eval", str(path), "-c", "configs/pipeline.yaml", f"data.root={tmp_path / 'nowhere'}")
    assert code == 2, err
    assert "another pipeline" in err and f"model.backbone: checkpoint has '{tiny.model.backbone}'" in err
    assert not (tmp_path / "eval").exists()


def test_train_resume_refuses_a_crafted_checkpoint(crafted, tmp_path):
    """train.resume reads the training state weights-only before Lightning loads anything."""
    path, marker = crafted
    code, err = run_cli("train", "-c", TINY[0], "-c", TINY[1], f"train.resume={path}",
                        f"train.out_dir={tmp_path / 'run'}", f"data.root={tmp_path / 'data'}", "train.precision=32-true")
    assert code == 2 and str(path) in err and "Traceback" not in err, err
    assert not marker.exists()


def test_overrides_without_files_apply_to_the_checkpoints_own_pipeline(tmp_path, tiny):
    """`stack eval model.pt data.root=...` evaluates the tiny network (the default pipeline would not fit it);
    an override that changes the network is refused, for export too."""
    from stack.checkpoint.model_file import load_for_deploy
    from stack.commands.eval import _checked_pipeline

    from stack.models import build_model

    path = save_model_checkpoint(tmp_path / "model.pt", tiny, build_model(tiny).state_dict())

    class Args:
        config, overrides, print_config = [], [f"data.root={tmp_path / 'shards'}"], False

    assert _checked_pipeline(str(path), Args).model == tiny.model
    Args.overrides = [f"model.bev_channels={tiny.model.bev_channels + 8}"]
    with pytest.raises(CheckpointError, match="model.bev_channels: checkpoint has"):
        _checked_pipeline(str(path), Args)
    with pytest.raises(CheckpointError, match="model.bev_channels: checkpoint has"):
        load_for_deploy(path, [], Args.overrides)


@pytest.mark.parametrize("payload, needle", [
    ({"state_dict": {}, "pipeline_yaml": "[1]"}, "must hold a mapping"),
    ({"state_dict": {}, "pipeline_yaml": "!!int x"}, "is not valid YAML"),
    ({"state_dict": {"w": 5}, "pipeline_yaml": None}, "maps 'w' to int '5', not a tensor"),
    ({"state_dict": {}, "pipeline_yaml": None}, "do not fit the network"),
    ({"state_dict": {"image_encoder.stem.weight": torch.zeros(2)}, "pipeline_yaml": None}, "1 unexpected"),
])
def test_crafted_but_loadable_checkpoints_are_bad_input(tmp_path, tiny, payload, needle):
    """Files that pass the weights-only loader but are not what `stack train` writes: exit 2, not a traceback."""
    path = tmp_path / "odd.pt"
    torch.save({**payload, "pipeline_yaml": payload["pipeline_yaml"] or pipeline_to_yaml(tiny)}, path)
    code, err = run_cli("eval", str(path))
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("header", ["[" * 200_000 + "]" * 200_000, '{"schema_version": 1e999}', "[1, 2]"])
def test_a_safetensors_network_with_a_hostile_header_is_refused_with_exit_2(tmp_path, header):
    """The pipeline of a .safetensors network is JSON in its metadata: read bounded, so a deep or out-of-range
    header is the same one-line refusal as a missing one, not a RecursionError."""
    from safetensors.torch import save_file

    path = tmp_path / "network.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"stack": header})
    code, err = run_cli("eval", str(path))
    assert code == 2 and "no stack pipeline" in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and not (tmp_path / "eval").exists()
