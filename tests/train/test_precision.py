"""Training precision on this hardware: bf16-mixed on a CPU without bf16 instructions trains in fp32, and says so;
so does a CPU whose bf16 instructions oneDNN or PyTorch are told not to use (how an AVX2-only CPU is emulated)."""

import os
import subprocess
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
    """An x86 CPU without AVX512-BF16 and AMX, with no limit set on oneDNN or PyTorch's kernels (whatever this
    machine is, or emulates)."""
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")


@pytest.fixture
def cpu_with_bf16(monkeypatch, cpu_without_bf16):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)


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


@pytest.mark.parametrize("isa, fast", [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_VNNI", False),
                                       ("AVX2_VNNI_2", False), ("AVX512_CORE_BF16", True), ("AVX512_CORE_AMX", True),
                                       ("AVX10_1_512", True), ("DEFAULT", True)])
def test_a_onednn_limit_below_avx512_bf16_is_a_cpu_without_bf16(monkeypatch, cpu_with_bf16, isa, fast):
    assert precision.cpu_has_fast_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert precision.cpu_has_fast_bf16() is fast
    chosen, notice = precision.effective_precision("bf16-mixed", "cpu")
    if fast:
        assert (chosen, notice) == ("bf16-mixed", None)
    else:
        assert chosen == "32-true" and f"ONEDNN_MAX_CPU_ISA={isa.upper()} keeps oneDNN below AVX512_CORE_BF16" in notice


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_pytorch_kernels_limited_below_avx512_are_a_cpu_without_bf16(monkeypatch, cpu_with_bf16, capability):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability.lower())
    chosen, notice = precision.effective_precision("bf16-mixed", "cpu")
    assert chosen == "32-true" and f"limited to {capability} (ATEN_CPU_CAPABILITY={capability.lower()})" in notice


def test_an_emulated_avx2_cpu_trains_in_fp32_and_says_why():
    """The settings `stack.cpu_emulation` uses to emulate an AVX2-only CPU, in a fresh process (oneDNN and PyTorch read
    them at start): bf16-mixed becomes 32-true, and the notice names the setting (or, on a CPU that really lacks
    bf16, the CPU)."""
    from stack.cpu_emulation import emulated_cpu_env

    probe = ("from stack.train.precision import effective_precision\n"
             "print(*effective_precision('bf16-mixed', 'cpu'), sep='\\n')")
    result = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **emulated_cpu_env("avx2")},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    chosen, notice = result.stdout.strip().split("\n")
    assert chosen == "32-true", notice
    assert ("ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN below AVX512_CORE_BF16" in notice
            or "this CPU has no bf16 matrix instructions" in notice), notice


def test_a_cpu_run_that_keeps_bf16_says_why(cpu_with_bf16, capsys):
    pipeline = tiny_pipeline("train.precision=bf16-mixed")
    assert precision.for_this_hardware(pipeline) is pipeline
    err = capsys.readouterr().err
    assert "train.precision=bf16-mixed: this CPU has bf16 matrix instructions (AVX512-BF16); training in bf16-mixed" in err
    assert precision.for_this_hardware(tiny_pipeline("train.precision=32-true")).train.precision == "32-true"
    assert capsys.readouterr().err == ""  # nothing was chosen: nothing to say
