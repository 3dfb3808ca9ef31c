"""Step statistics: an epoch boundary's validation and checkpointing are not reported as data
wait; MFU is never reported above 100%; a step's FLOPs are counted once."""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from standin import TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.train import callbacks
from stack.train.callbacks import StepStats, datasheet_peak, step_flop_counter
from stack.train.datamodule import ResumableLoader
from stack.train.fit import fit

VALIDATION_BATCH_S = 0.5


def slow_validation(pipeline):
    """The stand-in loaders, with every validation batch taking VALIDATION_BATCH_S to arrive."""
    make = synthetic_loaders(pipeline, 4)

    def loaders(split: str, rank: int, world: int):
        loader = make(split, rank, world)
        if split == "train":
            return loader

        def epoch_batches(epoch: int):
            for batch in loader.make_epoch(epoch):
                time.sleep(VALIDATION_BATCH_S)
                yield batch
        return ResumableLoader(epoch_batches, len(loader))
    return loaders


@pytest.mark.serial
def test_validation_between_epochs_is_not_data_wait(tmp_path):
    pipeline = tiny_pipeline("train.max_epochs=3", "train.log_every_n_steps=1", "train.seed=7",
                             f"train.out_dir={tmp_path}")
    _, _, stats = fit(pipeline, TinyMultiTask, slow_validation(pipeline), progress=False)
    first_steps = [row for row in stats.history if row["step"] in (5, 9)]  # the first step of epochs 1 and 2
    assert len(first_steps) == 2
    for row in first_steps:  # each came right after a validation of >= 1 s
        wait_s = row["perf/data_wait_share"] * row["perf/step_ms"] / 1000
        assert wait_s < VALIDATION_BATCH_S, f"step {row['step']}: {wait_s:.2f} s of data wait"
    assert all(row["perf/data_wait_share"] < 1 for row in stats.history)


# MFU: never above 100%, whatever the peak measured at train start was.

def fake_trainer(step: int = 10):
    return SimpleNamespace(world_size=1, global_step=step, optimizers=[], is_global_zero=True, callback_metrics={},
                           max_steps=100, max_epochs=1, num_training_batches=100, current_epoch=0)


def fake_module():
    return SimpleNamespace(device=torch.device("cpu"), parameters=lambda: [], log_dict=lambda *args, **kwargs: None)


def log_window(stats: StepStats, achieved_tflops: float, steps: int = 2) -> dict:
    """Log one window whose steps of 1 TFLOP each ran at `achieved_tflops` (no clock involved)."""
    stats.step_flops = 1e12
    stats._steps, stats._samples = steps, 2 * steps
    stats._compute, stats._wait = steps / achieved_tflops, 0.0
    stats._log(fake_trainer(), fake_module())
    return stats.history[-1]


def peaks_measured(monkeypatch, *peaks: float) -> list:
    """measure_peak_tflops replaced by one returning `peaks` in turn; the returned list records each call."""
    calls: list = []

    def measure(device, dtype):
        calls.append(dtype)
        return peaks[len(calls) - 1]
    monkeypatch.setattr(callbacks, "measure_peak_tflops", measure)
    return calls


def test_a_peak_measured_too_low_is_measured_again_and_mfu_stays_true(monkeypatch):
    calls = peaks_measured(monkeypatch, 0.5, 4.0)  # a busy machine at train start, a quiet one later
    said: list[str] = []
    monkeypatch.setattr(callbacks, "rank_zero_info", said.append)
    stats = StepStats(every=2)
    stats.on_train_start(fake_trainer(), fake_module())
    rows = [log_window(stats, rate) for rate in (0.4, 2.0, 1.0, 3.0)]
    assert [row["perf/mfu"] for row in rows] == pytest.approx([0.8, 0.5, 0.25, 0.75])
    assert len(calls) == 2 and stats.peak_tflops == 4.0 and not stats.peak_is_bound
    assert said[0] == "MFU/HFU peak: 0.5 TFLOP/s, measured CPU matmul peak (float32)"  # the source, once
    assert len(said) == 2 and said[1].startswith("peak re-measured: 4 TFLOP/s (was 0.5; a window achieved 2")


def test_a_window_above_every_measured_peak_reports_against_the_achieved_rate(monkeypatch, capsys):
    calls = peaks_measured(monkeypatch, 0.5, 1.0)  # still loaded at the re-measurement
    stats = StepStats(every=2, print_lines=True)
    stats.on_train_start(fake_trainer(), fake_module())
    rows = [log_window(stats, rate) for rate in (2.0, 1.0)]
    assert len(calls) == 2, "only the window above the peak re-measures"
    assert max(row["perf/mfu"] for row in rows) <= 1.0
    assert rows[0]["perf/mfu"] == 1.0 and rows[1]["perf/mfu"] == pytest.approx(0.5)
    assert stats.peak_tflops == 2.0 and stats.peak_is_bound
    lines = capsys.readouterr().out.splitlines()
    assert "MFU <=100.0%" in lines[0] and "MFU <=50.0%" in lines[1]


def test_re_measurements_are_bounded(monkeypatch):
    calls = peaks_measured(monkeypatch, *[0.1] * 10)
    stats = StepStats(every=2)
    stats.on_train_start(fake_trainer(), fake_module())
    rows = [log_window(stats, rate) for rate in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)]
    assert len(calls) == 1 + callbacks.MAX_REMEASURES
    assert all(row["perf/mfu"] <= 1.0 for row in rows)


def test_normal_windows_never_re_measure(monkeypatch):
    calls = peaks_measured(monkeypatch, 10.0)
    stats = StepStats(every=2)
    stats.on_train_start(fake_trainer(), fake_module())
    rows = [log_window(stats, rate) for rate in (1.0, 9.9, 5.0, 10.0)]
    assert len(calls) == 1
    assert [row["perf/mfu"] for row in rows] == pytest.approx([0.1, 0.99, 0.5, 1.0])


def test_a_configured_peak_below_the_achieved_rate_is_clamped_and_warned_once(monkeypatch, capsys):
    calls = peaks_measured(monkeypatch)
    stats = StepStats(every=2, peak_tflops=1.0, print_lines=True)
    stats.on_train_start(fake_trainer(), fake_module())
    with pytest.warns(UserWarning, match="train.peak_tflops=1 is below") as warned:
        rows = [log_window(stats, rate) for rate in (3.0, 0.5, 2.0)]
    assert len(warned) == 1 and not calls, "a configured peak is never re-measured"
    assert [row["perf/mfu"] for row in rows] == pytest.approx([1.0, 0.5, 1.0])
    assert rows[0]["perf/achieved_tflops"] == pytest.approx(3.0)
    lines = capsys.readouterr().out.splitlines()
    assert "MFU >100% (train.peak_tflops too low)" in lines[0] and "MFU 50.0%" in lines[1]


@pytest.mark.serial
def test_mfu_of_a_real_run_with_a_too_low_first_peak(monkeypatch, tmp_path):
    calls = peaks_measured(monkeypatch, 1e-9, 1e3)
    pipeline = tiny_pipeline("train.max_steps=4", "train.log_every_n_steps=2", f"train.out_dir={tmp_path}")
    _, _, stats = fit(pipeline, TinyMultiTask, synthetic_loaders(pipeline, 4), progress=False)
    assert len(calls) == 2
    assert all(0 < row["perf/mfu"] < 1 for row in stats.history)


# FLOPs of a step: a grouped convolution's weight gradient is not counted `groups` times.

def test_a_grouped_convolution_step_counts_three_forwards():
    conv = torch.nn.Conv2d(32, 64, 3, padding=1, groups=8)
    images = torch.randn(2, 32, 16, 16, requires_grad=True)
    forward = 2 * 2 * 16 * 16 * 64 * (32 // 8) * 9  # batch x pixels x out channels x in channels per group x taps
    with step_flop_counter() as counter:
        conv(images).sum().backward()
    assert counter.get_total_flops() == 3 * forward  # forward, input gradient, weight gradient


# MFU counts the model's FLOPs, HFU what the hardware runs (recomputation included).

@pytest.mark.serial
def test_activation_checkpointing_raises_hfu_not_mfu(tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("recomputed", ["train.activation_checkpointing=[backbone.*]"])):
        pipeline = tiny_pipeline("train.max_steps=2", "train.log_every_n_steps=2", f"train.out_dir={tmp_path / name}",
                                 *extra)
        _, _, runs[name] = fit(pipeline, TinyMultiTask, synthetic_loaders(pipeline, 4), progress=False)
    plain, recomputed = runs["plain"], runs["recomputed"]
    assert recomputed.model_flops == plain.model_flops == plain.step_flops  # the same model work
    assert recomputed.step_flops > 1.2 * recomputed.model_flops  # the backbone's forward runs twice
    row = recomputed.history[-1]
    assert row["perf/hfu"] > row["perf/mfu"]
    assert row["perf/mfu"] / row["perf/hfu"] == pytest.approx(recomputed.model_flops / recomputed.step_flops)
    assert plain.history[-1]["perf/mfu"] == plain.history[-1]["perf/hfu"]
    assert ", HFU " in row["mfu_text"]


def gpu_module(monkeypatch, name: str, sms: int = 132):
    """fake_module on a CUDA device called `name` with `sms` multiprocessors (no GPU touched)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(name=name, multi_processor_count=sms))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    return SimpleNamespace(**{**vars(fake_module()), "device": torch.device("cuda", 0)})


@pytest.mark.parametrize("name, precision, peak, label", [
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4, "datasheet H100 SXM bf16 dense peak"),
    ("NVIDIA H100 PCIe", "bf16-mixed", 756.5, "datasheet H100 PCIe bf16 dense peak"),
    ("NVIDIA A100-SXM4-80GB", "32-true", 156.0, "datasheet A100 tf32 dense peak"),  # cuDNN convolutions in TF32
    ("NVIDIA L4", "16-mixed", 121.0, "datasheet L4 fp16 dense peak"),
])
def test_known_gpus_use_their_datasheet_peak(monkeypatch, name, precision, peak, label):
    calls = peaks_measured(monkeypatch)
    stats = StepStats(every=2, precision=precision)
    stats.on_train_start(fake_trainer(), gpu_module(monkeypatch, name))
    assert stats.peak_tflops == peak and stats.peak_source.startswith(label) and not calls


def test_only_the_agx_orin_64gb_gets_its_datasheet_peak(monkeypatch):
    """Every Jetson Orin module's GPU is called "Orin": an Orin NX/Nano (fewer SMs, lower clocks, a fraction of the
    AGX's 42.5 TFLOP/s) must fall back to a labelled measured peak, or its MFU would read several times too low."""
    calls = peaks_measured(monkeypatch, 9.0, 6.0)
    stats = StepStats(every=2, precision="bf16-mixed")
    stats.on_train_start(fake_trainer(), gpu_module(monkeypatch, "Orin", sms=16))  # AGX Orin 64GB
    assert stats.peak_tflops == 42.5 and stats.peak_source.startswith("datasheet Jetson AGX Orin 64GB") and not calls
    for sms, measured in ((8, 9.0), (14, 6.0)):  # Orin NX 16GB / Orin Nano 8GB; AGX Orin 32GB
        stats = StepStats(every=2, precision="bf16-mixed")
        stats.on_train_start(fake_trainer(), gpu_module(monkeypatch, "Orin", sms=sms))
        assert stats.peak_tflops == measured and stats.peak_source.startswith("measured matmul peak (bfloat16; 'Orin'")
    assert datasheet_peak("Jetson Orin Nano", "bf16", 16) is None  # a name other than torch's exact "Orin"


def test_an_unknown_gpu_falls_back_to_a_labelled_measured_peak(monkeypatch):
    calls = peaks_measured(monkeypatch, 50.0)
    said: list[str] = []
    monkeypatch.setattr(callbacks, "rank_zero_info", said.append)
    stats = StepStats(every=2, precision="bf16-mixed")
    stats.on_train_start(fake_trainer(), gpu_module(monkeypatch, "NVIDIA H100 NVL"))  # not in the table
    assert calls == [torch.bfloat16] and stats.peak_tflops == 50.0
    assert said == ["MFU/HFU peak: 50 TFLOP/s, measured matmul peak (bfloat16; 'NVIDIA H100 NVL' is not in the "
                    "datasheet table)"]


def test_a_datasheet_peak_is_never_re_measured_and_clamps(monkeypatch, capsys):
    calls = peaks_measured(monkeypatch)
    stats = StepStats(every=2, precision="bf16-mixed", print_lines=True)
    stats.on_train_start(fake_trainer(), gpu_module(monkeypatch, "NVIDIA A100-PCIE-40GB"))
    with pytest.warns(UserWarning, match="datasheet A100 bf16 dense peak"):
        rows = [log_window(stats, rate) for rate in (400.0, 156.0)]
    assert not calls and [row["perf/mfu"] for row in rows] == pytest.approx([1.0, 0.5])
    assert "MFU >100% (datasheet peak too low)" in capsys.readouterr().out


class RecordingDDP(torch.nn.parallel.DistributedDataParallel):
    """A DistributedDataParallel (isinstance-wise) that records comm hooks instead of needing a process group."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.hooks: list = []

    def register_comm_hook(self, state, hook):
        self.hooks.append(hook)


@pytest.mark.parametrize("count", [False, True])
def test_a_two_rank_run_counts_comm_bytes_only_when_asked(monkeypatch, count):
    """Counting swaps DDP's C++ all-reduce for the Python default hook and wraps the collectives: an ordinary
    multi-rank run (train.count_comm_bytes false) must do neither; `stack bench train-memory` asks for it."""
    import torch.distributed as dist

    from stack.train import comm

    names = [name for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                               "reduce_scatter_tensor", "all_reduce") if hasattr(dist, name)]
    for name in names:  # restored after the test whatever on_train_start wraps
        monkeypatch.setattr(dist, name, getattr(dist, name))
    monkeypatch.setattr(comm, "_originals", {})
    before = {name: getattr(dist, name) for name in names}
    model = RecordingDDP()
    trainer = SimpleNamespace(**{**vars(fake_trainer()), "world_size": 2, "strategy": SimpleNamespace(model=model)})
    stats = StepStats(every=2, peak_tflops=1.0, count_comm=count)
    stats.on_train_start(trainer, fake_module())
    wrapped = [name for name in names if getattr(dist, name) is not before[name]]
    if count:
        assert len(model.hooks) == 1 and wrapped == names and stats.comm is not None
        stats.on_train_end(trainer, fake_module())
    else:
        assert model.hooks == [] and wrapped == [] and stats.comm is None


def test_train_count_comm_bytes_is_off_by_default():
    from stack.config import load_pipeline

    assert load_pipeline(["configs/pipeline.yaml"]).train.count_comm_bytes is False
