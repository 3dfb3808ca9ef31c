"""`stack bench train-step`: the floor column never reports a bound the step already beats."""

from pathlib import Path

from stack.train.bench import floor_cell


def test_floor_cell_prints_the_bound_when_the_step_is_above_it():
    row = {"gflop": 50.6, "peak_tflops": 0.16, "floor_ms": 50.6 / 0.16, "step_ms": 858.0}
    assert floor_cell(row) == "316 (50.6 GFLOP / 0.16 TFLOP/s)"


def test_floor_cell_refuses_a_bound_slower_than_the_measured_step():
    # bf16 on a CPU without bf16 instructions: the matmul probe crawls, the convolutions do not.
    row = {"gflop": 50.6, "peak_tflops": 0.0014, "floor_ms": 50.6 / 0.0014, "step_ms": 8642.0}
    cell = floor_cell(row)
    assert cell.startswith("none")
    assert "slower than the step" in cell and "0.0014 TFLOP/s" in cell


# `stack bench train-memory`: the bf16-gather bar fails a run whose bf16-mixed FSDP2 still gathers fp32.

def memory_row(state_mb: float, comm: dict, wire_mb: float | None = None, resent_mb: float | None = None) -> dict:
    return {"train_state_mb": state_mb, "peak_memory_mb": 1500.0, "step_ms": 3000.0, "rank": 0, "comm": comm,
            "params": 2_615_797, "fp32_params": 23_005, "wire_mb": wire_mb, "retransmitted_mb": resent_mb}


def sent(kind_dtype_mb: dict) -> dict:
    return {key: {"calls": 1.0, "payload_mb": 2 * mb, "sent_mb": mb} for key, mb in kind_dtype_mb.items()}


def run_memory_with(monkeypatch, bf16_gathers: dict) -> tuple[int, str]:
    import io
    from contextlib import redirect_stdout
    from types import SimpleNamespace

    from stack.train import bench

    rows = {"32-true ddp": memory_row(39.9, sent({"all_reduce/float32": 9.98})),
            "32-true fsdp": memory_row(20.0, sent({"all_gather/float32": 10.01, "reduce_scatter/float32": 5.01}),
                                       wire_mb=15.03, resent_mb=0.02),
            "bf16-mixed fsdp": memory_row(20.0, sent({**bf16_gathers, "reduce_scatter/float32": 5.01}), wire_mb=15.09)}

    def child(config, overrides, mode):
        keys = dict(o.split("=", 1) for o in overrides if o.startswith("train."))
        assert keys.get("train.count_comm_bytes") == "true", "the bench's rows need the bytes counted"
        return rows[f"{keys['train.precision']} {keys['train.strategy']}"]
    monkeypatch.setattr(bench, "_child", child)
    out = io.StringIO()
    with redirect_stdout(out):
        code = bench.run_memory(None, SimpleNamespace(config=[], overrides=[]))
    return code, out.getvalue()


def test_train_memory_passes_bf16_gathers_and_fails_fp32_ones(monkeypatch):
    code, text = run_memory_with(monkeypatch, {"all_gather/bfloat16": 4.96, "all_gather/float32": 0.09})
    assert code == 0 and "bf16 gathers send 0.50x the bytes of fp32 gathers" in text
    assert "| fsdp | bf16-mixed | 20.0 | 0.50 | 1500 | 3000 | 5.05 (bfloat16, float32) / 5.01 (float32) / - | " \
           "10.06 | 15.09 (1.50x) | 10.02 |" in text
    assert "| ddp | 32-true | 39.9 | 1.00 | 1500 | 3000 | - / - / 9.98 (float32) | 9.98 | not readable here |" in text
    assert "| 15.02 | 15.03 (1.00x), 0.02 resent |" in text  # what TCP sent again is shown apart, never in the count
    code, text = run_memory_with(monkeypatch, {"all_gather/float32": 10.01})  # no MixedPrecisionPolicy
    assert code == 1 and "1.00x the bytes" in text


def test_a_gpu_fp32_step_counts_against_tf32_while_cudnn_may_use_it(monkeypatch):
    # cuDNN runs fp32 convolutions in TF32 unless told not to: measured against the FP32 peak, an H100's
    # default-preset step read 35% "MFU" where the TF32 peak gives 4.7%.
    import torch

    from stack.train.callbacks import precision_key

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert precision_key("32-true", cuda) == "tf32" and precision_key("32-true", cpu) == "fp32"
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert torch.get_float32_matmul_precision() == "highest"
    assert precision_key("32-true", cuda) == "fp32"
    assert precision_key("bf16-mixed", cuda) == "bf16"


# `stack bench checkpoint`: the loop it times checkpoints as each mode says.

def test_the_checkpoint_bench_loop_writes_synchronously_asynchronously_or_not_at_all(monkeypatch, tmp_path):
    """A synchronous checkpoint is `latest` before the next step starts (the loop waited for it); without
    checkpoints the run writes none until its end; every mode runs the same timed steps."""
    from stack.config import load_pipeline
    from stack.train import checkpoint_bench

    monkeypatch.setattr(checkpoint_bench, "LOOP_EVERY", 2)
    monkeypatch.setattr(checkpoint_bench, "LOOP_CHECKPOINTS", 1)
    seen: dict[str, list[bool]] = {}

    class Spy(checkpoint_bench.StepClock):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            latest = Path(self.folder) / "checkpoints" / "latest"
            seen.setdefault(self.mode, []).append(latest.is_file())
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"],
                             ["data.batch_size=1", "train.precision=32-true"])
    for mode in ("none", "sync"):
        Spy.mode, Spy.folder = mode, tmp_path / mode
        monkeypatch.setattr(checkpoint_bench, "StepClock", Spy)
        seconds = checkpoint_bench.loop_seconds(pipeline, tmp_path / mode, mode)
        assert seconds > 0
    # step starts 1..4: the checkpoint after step 2 is on disk when step 3 starts, only when synchronous
    assert seen["none"] == [False, False, False, False]
    assert seen["sync"] == [False, False, True, True]


def test_step_cases_keep_the_figure_names_their_history_has():
    """Records written before the GroupNorm and AdamW cases existed compare figure by figure with new ones."""
    from stack.train.bench import STEP_CASES

    labels = [case.label for case in STEP_CASES]
    assert labels[:5] == ["step: 32-true, checkpointing none", "step: bf16-mixed, checkpointing none",
                          "step: 32-true, checkpointing image_encoder, bev_encoder",
                          "step: bf16-mixed, checkpointing image_encoder, bev_encoder",
                          "step: 32-true, checkpointing none, NCHW images"]
    assert len(set(labels)) == len(labels)
