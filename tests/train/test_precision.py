"""Training precision on this hardware: bf16-mixed on a CPU without bf16 instructions trains in fp32, and says so."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.train import precision
from stack.train.fit import fit


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)


def test_cpu_bf16_support_follows_the_instruction_set(monkeypatch, cpu_without_bf16):
    assert not precision.cpu_has_fast_bf16()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.cpu_has_fast_bf16()
    monkeypatch.setattr(precision.platform, "machine", lambda: "aarch64")
    assert precision.cpu_has_fast_bf16()  # PyTorch reports nothing there: the config is trusted


def test_only_bf16_on_a_cpu_without_bf16_changes(cpu_without_bf16):
    chosen, notice = precision.effective_precision("bf16-mixed", "cpu")
    assert chosen == "32-true" and "AVX512-BF16" in notice and "32-true" in notice
    assert precision.effective_precision("32-true", "cpu") == ("32-true", None)
    assert precision.effective_precision("16-mixed", "cpu") == ("16-mixed", None)
    assert precision.effective_precision("bf16-mixed", "gpu") == ("bf16-mixed", None)


def test_training_asks_bf16_on_a_cpu_without_it_and_runs_fp32(tmp_path, cpu_without_bf16, capsys):
    pipeline = tiny_pipeline("train.precision=bf16-mixed", f"train.out_dir={tmp_path}", "train.max_epochs=1")
    module, trainer, _ = fit(pipeline, TinyMultiTask, synthetic_loaders(pipeline, 2), progress=False)
    assert trainer.precision == "32-true" and module.pipeline.train.precision == "32-true"
    assert "no bf16 matrix instructions" in capsys.readouterr().err
    assert "precision: 32-true" in (tmp_path / "pipeline.yaml").read_text()  # the run records what it trained in
