"""Training observability with low overhead: throughput, data wait vs compute, MFU/HFU, memory, communication.

Per step the callback only reads a clock at batch start and end (data wait = time
from the end of one step to the start of the next, which is where the loader is
pulled; compute = start to end). Every `log_every_n_steps` it synchronises the device
once and logs averages over the window, so the device is not stalled every step.

MFU and HFU (PaLM, appendix B, https://arxiv.org/abs/2204.02311): MFU = the model's
FLOPs per second (forward + backward, no recomputation) over the device's peak; HFU
counts the FLOPs the hardware really runs, recomputation under activation
checkpointing included, so HFU >= MFU and the two are equal without checkpointing.
The FLOPs of one training step are counted once, on the first step, with
`torch.utils.flop_counter` through `step_flop_counter`: torch's convolution-backward
formula counts a grouped convolution's weight gradient `groups` times over, which made a
tiny-preset step (batch 4) of 32.0 GFLOP count as 50.6; here each gradient of a convolution
costs what its forward does. The recomputed forwards are counted separately (the
checkpointed modules run their recomputation inside `RECOMPUTE.contexts`, see
`stack.train.parallel.apply_activation_checkpointing`): with the image and BEV encoders
checkpointed that tiny-preset step runs 41.2 GFLOP of which 32.0 are the model's.

The peak, in this order: `train.peak_tflops` when set; the datasheet dense peak of a
known GPU at the training precision (`DATASHEET_PEAKS`: H100 SXM/PCIe, H200, A100, L4,
Jetson AGX Orin); otherwise (CPUs, unknown GPUs) a short matmul at the training precision
measured when training starts (`measure_peak_tflops`), labelled "measured CPU matmul peak"
or "measured matmul peak". Where the peak came from is logged once at train start.
A utilisation above 100% is never reported:

- measured peak: a measurement taken while other jobs held the cores is too low, so a
  window whose achieved rate exceeds the peak re-measures it (the machine is evidently
  quieter now; at most MAX_REMEASURES times a run) and keeps the highest peak seen. If the
  window still beats it, the achieved rate is a lower bound of the peak and becomes the
  peak: `perf/mfu` is then an upper bound, printed with `<=` (`MFU <=100.0%`). Each
  re-measurement is logged ("peak re-measured: X TFLOP/s"), the switch to an achieved-rate
  peak once. Windows below the peak never re-measure.
- configured or datasheet peak: nothing is re-measured; a window above it logs
  `perf/mfu` = 1.0, prints `MFU >100% (train.peak_tflops too low)` and warns once.

`perf/achieved_tflops` (the hardware's rate) is logged either way: it needs no peak.
On more than one rank with `count_comm=True` (train.count_comm_bytes), `perf/comm_sent_mb` is what this rank
sent in collectives per step (`stack.train.comm`, measured at the calls) and `perf/comm_wire_mb` what it put
on the wire in the same windows (TCP payload bytes the kernel counted, each once; gloo only, absent where the
kernel cannot say), `perf/comm_retransmitted_mb` the bytes it sent again (a lossy network, or a late ACK on a
busy machine).
Counting is opt-in: it wraps
torch.distributed's collectives and swaps DDP's C++ gradient all-reduce for torch's Python default comm hook,
a cost and a change of code path no ordinary training run should carry to log one number.
"""

from __future__ import annotations

import contextlib
import re
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from stack.train.comm import WireCount

MAX_REMEASURES = 3
"""Peak re-measurements a run may make (each costs about a second of training)."""

_H100_SXM = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
DATASHEET_PEAKS: list[tuple[str, str, dict[str, float], str]] = [
    # (pattern of torch.cuda.get_device_name, device, dense TFLOP/s per dtype (no sparsity), source)
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
     "NVIDIA H100 Tensor Core GPU datasheet (half the 'with sparsity' figures)"),
    (r"H100(?!.*NVL)", "H100 SXM", _H100_SXM,
     "NVIDIA H100 Tensor Core GPU datasheet (half the 'with sparsity' figures)"),
    (r"H200(?!.*NVL)", "H200 SXM", _H100_SXM, "NVIDIA H200 Tensor Core GPU datasheet (half the sparsity figures)"),
    (r"A100", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
     "NVIDIA A100 Tensor Core GPU datasheet"),
    (r"\bL4\b", "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
     "NVIDIA L4 Tensor Core GPU datasheet (half the sparsity figures)"),
    (r"^Orin$", "Jetson AGX Orin 64GB", {"bf16": 42.5, "fp16": 42.5, "fp32": 5.3},
     "NVIDIA Jetson AGX Orin Series Technical Brief (dense FP16 tensor core, FP32 CUDA core)"),
]
"""Dense peaks of known GPUs. 32-true counts as fp32 unless torch lets matmuls use TF32."""
SM_COUNTS = {"Jetson AGX Orin 64GB": 16}
"""Devices whose name torch does not tell apart from slower siblings: every Jetson Orin module's integrated GPU
reports the name "Orin" (AGX Orin 64GB: 16 SMs at 1.3 GHz; AGX Orin 32GB 14, Orin NX 8 or 6, Orin Nano 8 or 4
SMs at lower clocks; Jetson Orin Series technical briefs), so the table's peak applies only at this SM count."""


def precision_key(precision: str, device: torch.device) -> str:
    """The datasheet column a run at `precision` on `device` is measured against.

    A 32-true run on a GPU counts as TF32 when cuDNN may run its convolutions in TF32
    (`torch.backends.cudnn.allow_tf32`, True by default) or matmuls may
    (`torch.set_float32_matmul_precision`): measured on an H100, the default preset's fp32 step
    ran at 35% of the FP32 peak, which only TF32 convolutions reach; against the TF32 peak, 4.7%.
    """
    if precision == "bf16-mixed":
        return "bf16"
    if precision == "16-mixed" and device.type == "cuda":
        return "fp16"
    if device.type != "cuda":
        return "fp32"
    tf32 = torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def datasheet_peak(device_name: str, key: str, sm_count: int | None = None) -> tuple[float, str] | None:
    """(dense TFLOP/s, "datasheet: <device> <key> dense peak (<source>)") of a known GPU, else None (an Orin
    NX/Nano or AGX Orin 32GB, whose name is the AGX Orin 64GB's, is told apart by `sm_count`: `SM_COUNTS`)."""
    for pattern, device, peaks, source in DATASHEET_PEAKS:
        if device in SM_COUNTS and sm_count != SM_COUNTS[device]:
            continue
        if re.search(pattern, device_name) and key in peaks:
            return peaks[key], f"datasheet {device} {key} dense peak ({source})"
    return None


class RecomputeFlops:
    """FLOPs of the forwards that activation checkpointing re-runs in backward, while `counting`.

    `contexts` is the `context_fn` of the checkpointed modules: torch enters its second
    context around each recomputation, here a FLOP counter of its own. (The counter is
    handed to torch as the context itself: wrapped in a generator context manager it
    counted nothing.)"""

    def __init__(self):
        self._counting = False
        self._counters: list[FlopCounterMode] = []

    @property
    def counting(self) -> bool:
        return self._counting

    @counting.setter
    def counting(self, value: bool) -> None:
        if value:
            self._counters = []
        self._counting = value

    @property
    def flops(self) -> int:
        return sum(counter.get_total_flops() for counter in self._counters)

    def contexts(self):
        if not self.counting:
            return contextlib.nullcontext(), contextlib.nullcontext()
        self._counters.append(step_flop_counter())
        return contextlib.nullcontext(), self._counters[-1]


RECOMPUTE = RecomputeFlops()


def conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                       _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """FLOPs of `aten.convolution_backward`: each requested gradient (input, weight) costs the forward's.

    torch's own formula builds the weight gradient as a convolution of the input with the
    output gradient but with all input channels, so a grouped convolution's weight gradient
    is counted `groups` times over (regnetx_002 has groups up to 46)."""
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def step_flop_counter() -> FlopCounterMode:
    """A FlopCounterMode that counts a training step's convolution backward right (`conv_backward_flop`)."""
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: conv_backward_flop})


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
    """Logs samples/s, data-wait share, step time, MFU/HFU, memory and bytes sent every `every` steps.

    Data wait is the time from the end of one training step (or the start of an epoch) to the
    start of the next step. Validation runs and what follows it (checkpoints) are neither
    data wait nor compute: the clock stops at `on_validation_start` and restarts at the next
    epoch start or validation end, so an epoch boundary is not reported as a slow loader.
    """

    def __init__(self, every: int, peak_tflops: float = 0.0, precision: str = "32-true", print_lines: bool = False,
                 count_comm: bool = False):
        self.every = every
        self.count_comm = count_comm
        self.print_lines = print_lines
        self.peak_tflops = peak_tflops
        self.peak_configured = peak_tflops > 0
        self.peak_is_bound = False  # the peak is an achieved rate: MFU is an upper bound
        self.remeasures = 0
        self._peak_warned = False
        self._peak_dtype = torch.float32
        self.precision = precision
        self.peak_source = "train.peak_tflops (configured)" if self.peak_configured else ""
        self.step_flops: float | None = None  # what the hardware runs (HFU)
        self.model_flops: float | None = None  # the model's forward + backward (MFU); step_flops when None
        self._counter: FlopCounterMode | None = None
        self.comm = None  # stack.train.comm.CommBytes on more than one rank, when count_comm
        self.wire = None  # stack.train.comm.WireBytes beside it
        self._wire_start = None  # stack.train.comm.WireCount at this step's start
        self._wire_sent = None  # and summed over the window's steps; None once the kernel cannot say
        self._reset_window()
        self._last_end: float | None = None
        self._start = 0.0
        self.history: list[dict] = []

    def _reset_window(self) -> None:
        self._wait = self._compute = 0.0
        self._samples = self._steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        dtype = PRECISION_DTYPES[self.precision]
        if pl_module.device.type == "cpu" and dtype == torch.float16:
            dtype = torch.float32  # CPUs have no fast fp16 path; report against fp32
        self._peak_dtype = dtype
        if not self.peak_configured:
            self._choose_peak(pl_module.device)
        rank_zero_info(f"MFU/HFU peak: {self.peak_tflops:.4g} TFLOP/s, {self.peak_source}")
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        if self.count_comm and trainer.world_size > 1:
            from stack.train.comm import CommBytes, WireBytes, count_ddp

            self.comm = CommBytes()
            self.wire = WireBytes()
            self._wire_sent = WireCount(0, 0)
            count_ddp(trainer.strategy.model)

    def _choose_peak(self, device: torch.device) -> None:
        """The datasheet peak of a known GPU, else a measured matmul peak (labelled as such)."""
        key = precision_key(self.precision, device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        sms = torch.cuda.get_device_properties(device).multi_processor_count if name else None
        known = datasheet_peak(name, key, sms) if name else None
        if known is not None:
            (self.peak_tflops, self.peak_source), self.peak_configured = known, True
            return
        self.peak_tflops = measure_peak_tflops(device, self._peak_dtype)
        dtype = str(self._peak_dtype).removeprefix("torch.")
        self.peak_source = (f"measured CPU matmul peak ({dtype})" if device.type == "cpu" else
                            f"measured matmul peak ({dtype}; {name!r} is not in the datasheet table)")

    def on_train_end(self, trainer, pl_module) -> None:
        if self.comm is not None:
            self.comm.close()

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
            self._counter = step_flop_counter()
            self._counter.__enter__()
            RECOMPUTE.counting = True  # and forgets earlier counts
        if self.comm is not None:
            self.comm.counting = True
            self._wire_start = self.wire.total()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._counter is not None:  # forward + backward of the first step are counted
            self._counter.__exit__(None, None, None)
            self.step_flops = float(self._counter.get_total_flops())
            self.model_flops = self.step_flops - RECOMPUTE.flops
            RECOMPUTE.counting = False
            self._counter = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.comm is not None:
            self.comm.counting = False
            self._count_wire()
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

    def _count_wire(self) -> None:
        """Add the TCP bytes sent since this step started (None from then on if the kernel cannot say)."""
        end = self.wire.total()
        if self._wire_start is None or end is None or self._wire_sent is None:
            self._wire_sent = None
        else:
            self._wire_sent += end - self._wire_start

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
        mfu_text, comm = "", None
        if self.step_flops:
            achieved = self.step_flops / step_s / 1e12
            stats["perf/achieved_tflops"] = achieved
            if self.peak_tflops:
                hfu, hfu_text = self._mfu(achieved, pl_module.device)  # the peak is judged by the hardware's rate
                model_share = (self.model_flops if self.model_flops is not None else self.step_flops) / self.step_flops
                stats["perf/mfu"], stats["perf/hfu"] = hfu * model_share, hfu
                mfu_text = hfu_text if model_share == 1 else (
                    f"{'<=' if self.peak_is_bound else ''}{100 * hfu * model_share:.1f}%, HFU {hfu_text}")
        if self.comm is not None:
            comm = self.comm.summary(self._steps)
            stats["perf/comm_sent_mb"] = self.comm.sent_bytes() / self._steps / 2**20
            if self._wire_sent is not None:
                stats["perf/comm_wire_mb"] = self._wire_sent.payload / self._steps / 2**20
                stats["perf/comm_retransmitted_mb"] = self._wire_sent.retransmitted / self._steps / 2**20
                self._wire_sent = WireCount(0, 0)
            self.comm.reset()
        self.history.append({"step": trainer.global_step, **stats, "mfu_text": mfu_text, "comm": comm})
        pl_module.log_dict(stats, on_step=True, on_epoch=False, rank_zero_only=True)
        if self.print_lines and trainer.is_global_zero:
            loss = trainer.callback_metrics.get("loss")
            total = trainer.max_steps if trainer.max_steps > 0 else trainer.max_epochs * trainer.num_training_batches
            print(f"step {trainer.global_step}/{total} epoch {trainer.current_epoch} "
                  f"loss {float(loss) if loss is not None else float('nan'):.4f} "
                  f"{stats['perf/samples_per_s']:.1f} samples/s, step {stats['perf/step_ms']:.0f} ms, "
                  f"data wait {100 * stats['perf/data_wait_share']:.0f}%, MFU {mfu_text or 'n/a'}, "
                  f"peak mem {stats['perf/peak_memory_mb']:.0f} MiB", flush=True)
        self._reset_window()

    def _mfu(self, achieved: float, device: torch.device) -> tuple[float, str]:
        """(utilisation, its printed form) of a window whose hardware achieved `achieved` TFLOP/s; never above 1."""
        if achieved > self.peak_tflops and self.peak_configured:
            configured = self.peak_source.startswith("train.peak_tflops")
            if not self._peak_warned:
                rank_zero_warn(f"{'train.peak_tflops' if configured else 'the ' + self.peak_source}="
                               f"{self.peak_tflops:g} is below the {achieved:.4g} TFLOP/s this run achieves: MFU is "
                               "shown as >100% (clamped to 1.0 in perf/mfu); set the device's real peak in "
                               "train.peak_tflops")
                self._peak_warned = True
            return 1.0, f">100% ({'train.peak_tflops' if configured else 'datasheet peak'} too low)"
        if achieved > self.peak_tflops:
            self._raise_peak(achieved, device)
        mfu = achieved / self.peak_tflops
        return mfu, f"{'<=' if self.peak_is_bound else ''}{100 * mfu:.1f}%"

    def _raise_peak(self, achieved: float, device: torch.device) -> None:
        """A window beat the measured peak, so that measurement was low: re-measure, keep the highest."""
        before = self.peak_tflops
        if self.remeasures < MAX_REMEASURES:
            self.remeasures += 1
            measured = measure_peak_tflops(device, self._peak_dtype)
            self.peak_tflops = max(self.peak_tflops, measured)
            self.peak_is_bound = self.peak_is_bound and measured < achieved
            rank_zero_info(f"peak re-measured: {self.peak_tflops:.4g} TFLOP/s (was {before:.4g}; a window achieved "
                           f"{achieved:.4g}: the first measurement ran on a busier machine)")
        if achieved > self.peak_tflops:
            if not self.peak_is_bound:
                rank_zero_info(f"achieved {achieved:.4g} TFLOP/s is above the measured peak {self.peak_tflops:.4g}: "
                               "the best achieved rate is used as the peak, so MFU is an upper bound (<=)")
            self.peak_tflops, self.peak_is_bound = achieved, True


class LoaderPosition(pl.Callback):
    """Tells the resumable training loader how many batches of the epoch training has finished."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loader = trainer.train_dataloader
        if hasattr(loader, "mark"):
            loader.mark(trainer.current_epoch, batch_idx + 1)
