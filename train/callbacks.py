"""Training observability with low overhead: throughput, data wait vs compute, MFU, peak memory.

Per step the callback only reads a clock at batch start and end (data wait = time
from the end of one step to the start of the next, which is where the loader is
pulled; compute = start to end). Every `log_every_n_steps` it synchronises the device
once and logs averages over the window, so the device is not stalled every step.

MFU = achieved FLOP/s / peak FLOP/s. The FLOPs of one training step (forward +
backward) are counted once, on the first step, with `torch.utils.flop_counter`;
the peak is `train.peak_tflops` or, when 0, measured once with a large matmul at the
training precision (`measure_peak_tflops`). Method: PaLM, appendix B
(https://arxiv.org/abs/2204.02311).
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from torch.utils.flop_counter import FlopCounterMode


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 0.5) -> float:
    """Dense matmul TFLOP/s this device reaches at `dtype` (the best of a short run).

    The matrix shrinks (down to 256) when one product would take more than a quarter of
    `seconds`: without bf16 instructions a 2048² bf16 product takes about a minute on a CPU.
    """
    size = min(size, _affordable_size(device, dtype, seconds / 4))
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up (and lazy init of the BLAS)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best / 1e12


def _affordable_size(device: torch.device, dtype: torch.dtype, budget_s: float, probe: int = 256) -> int:
    """The largest power-of-two matrix side (>= probe) whose product fits `budget_s`, from one probe product."""
    a = torch.randn(probe, probe, device=device, dtype=dtype)
    torch.mm(a, a)
    _sync(device)
    start = time.perf_counter()
    torch.mm(a, a)
    _sync(device)
    elapsed, size = time.perf_counter() - start, probe
    while elapsed * 8 <= budget_s and size < 1 << 14:
        size, elapsed = size * 2, elapsed * 8
    return size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA), or this process's peak resident memory (CPU), MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def training_state_mb(module: torch.nn.Module, optimizers) -> float:
    """MiB this rank holds for parameters + gradients + optimizer state (its shards under FSDP2)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in module.parameters():
        total += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total / 2**20


PRECISION_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class StepStats(pl.Callback):
    """Logs samples/s, data-wait share, step time, MFU and peak memory every `every` steps.

    Data wait is the time from the end of one training step (or the start of an epoch) to the
    start of the next step. Validation runs and what follows it (checkpoints) are neither
    data wait nor compute: the clock stops at `on_validation_start` and restarts at the next
    epoch start or validation end, so an epoch boundary is not reported as a slow loader.
    """

    def __init__(self, every: int, peak_tflops: float = 0.0, precision: str = "32-true", print_lines: bool = False):
        self.every = every
        self.print_lines = print_lines
        self.peak_tflops = peak_tflops
        self.precision = precision
        self.step_flops: float | None = None
        self._counter: FlopCounterMode | None = None
        self._reset_window()
        self._last_end: float | None = None
        self._start = 0.0
        self.history: list[dict] = []

    def _reset_window(self) -> None:
        self._wait = self._compute = 0.0
        self._samples = self._steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.peak_tflops:
            dtype = PRECISION_DTYPES[self.precision]
            if pl_module.device.type == "cpu" and dtype == torch.float16:
                dtype = torch.float32  # CPUs have no fast fp16 path; report against fp32
            self.peak_tflops = measure_peak_tflops(pl_module.device, dtype)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._last_end = time.perf_counter()  # the loader's start-up and first batch are data wait

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last_end = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":  # training resumes from here (an epoch start resets it again)
            self._last_end = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()
        if self._last_end is not None:
            self._wait += self._start - self._last_end
        if self.step_flops is None and self._counter is None:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._counter is not None:  # forward + backward of the first step are counted
            self._counter.__exit__(None, None, None)
            self.step_flops = float(self._counter.get_total_flops())
            self._counter = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._compute += now - self._start
        self._samples += batch.images.shape[0] if hasattr(batch, "images") else 0
        self._steps += 1
        if self._steps >= self.every:
            _sync(pl_module.device)  # once per window: the queued device work belongs to this window
            synced = time.perf_counter()
            self._compute += synced - now
            self._log(trainer, pl_module)
            now = synced
        self._last_end = now

    def _log(self, trainer, pl_module) -> None:
        busy = self._wait + self._compute
        step_s = busy / self._steps
        stats = {
            "perf/samples_per_s": self._samples * trainer.world_size / busy,
            "perf/step_ms": 1000 * step_s,
            "perf/data_wait_share": self._wait / busy,
            "perf/peak_memory_mb": peak_memory_mb(pl_module.device),
            "perf/train_state_mb": training_state_mb(pl_module, trainer.optimizers),
        }
        if self.step_flops and self.peak_tflops:
            stats["perf/mfu"] = self.step_flops / step_s / (self.peak_tflops * 1e12)
        self.history.append({"step": trainer.global_step, **stats})
        pl_module.log_dict(stats, on_step=True, on_epoch=False, rank_zero_only=True)
        if self.print_lines and trainer.is_global_zero:
            loss = trainer.callback_metrics.get("loss")
            total = trainer.max_steps if trainer.max_steps > 0 else trainer.max_epochs * trainer.num_training_batches
            print(f"step {trainer.global_step}/{total} epoch {trainer.current_epoch} "
                  f"loss {float(loss) if loss is not None else float('nan'):.4f} "
                  f"{stats['perf/samples_per_s']:.1f} samples/s, step {stats['perf/step_ms']:.0f} ms, "
                  f"data wait {100 * stats['perf/data_wait_share']:.0f}%, MFU {100 * stats.get('perf/mfu', 0):.1f}%, "
                  f"peak mem {stats['perf/peak_memory_mb']:.0f} MiB", flush=True)
        self._reset_window()


class LoaderPosition(pl.Callback):
    """Tells the resumable training loader how many batches of the epoch training has finished."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loader = trainer.train_dataloader
        if hasattr(loader, "mark"):
            loader.mark(trainer.current_epoch, batch_idx + 1)
