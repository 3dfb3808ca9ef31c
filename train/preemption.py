"""Preemption-safe training under SLURM: stop at a step boundary, checkpoint, requeue, resume with no flag.

The sbatch script (`stack.train.launch`) asks for `--requeue` and `--signal=USR1@N`: SLURM
sends SIGUSR1 to every task of the job N seconds before the time limit (`scancel
--signal=USR1 JOB` sends the same). When a run is preempted, or requeued from outside
(`scontrol requeue`), the tasks get SIGTERM and, `KillWait`/`GraceTime` seconds later, SIGKILL.

Lightning's `SLURMEnvironment(auto_requeue=True, requeue_signal=SIGUSR1)` reads the ranks and
registers the signal handlers, but neither of its handlers is kept:
- its SIGUSR1 handler calls `trainer.save_checkpoint(hpc_ckpt_N.ckpt)` inside the signal handler,
  that is between any two bytecodes of the step (half-way through `optimizer.step()`, or while
  another rank waits in a gradient all-reduce, where the save's barrier deadlocks), into
  `default_root_dir` (the working folder, shared by every run started there) without the atomic
  rename, the finite check or `checkpoints/latest`, and the requeued job loads it behind
  `train.resume`'s checks;
- its SIGTERM handler broadcasts inside the handler, which fails or hangs when a peer has exited
  or is inside another collective (Lightning issue 20806, PR 20825).
Lightning keeps a SIGUSR1 handler that is already installed, and SIGTERM's is replaced once
training starts, so `RequeueOnSignal`'s handlers only record the signal. At the end of the step
every rank agrees (a max all-reduce, so a signal that reached one rank a moment before the others
stops all of them at the same step; over a gloo group of its own, on a CPU tensor, so a GPU run pays no
device sync per step for it), the rolling checkpoint is written blocking
(`RollingCheckpoints.save(..., blocking=True)`: the same files and `latest` as every other
checkpoint), and rank 0 runs `scontrol requeue $SLURM_JOB_ID`. On SIGTERM the same checkpoint is
written but the job is not requeued from here: under preemption with `PreemptMode=REQUEUE` SLURM
requeues a `--requeue` job itself, and a SIGTERM from the user's `scancel` means stop, which a
requeue would undo.

The requeued job runs the same script with `SLURM_RESTART_COUNT` > 0; `resume_after_requeue`
then makes `train.resume` the out_dir's `latest` (and turns `train.overwrite` off, which
would otherwise delete the progress the job came back for).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from stack.errors import StackError
from stack.pipeline import Pipeline
from stack.train.checkpoints import LATEST, RollingCheckpoints

REQUEUE_SIGNAL = signal.SIGUSR1
"""What `#SBATCH --signal` asks for before the time limit (Lightning's default requeue signal too)."""


class TrainingRequeued(StackError):
    """Training stopped on SLURM's signal after writing a checkpoint. Exit 0 when this job requeued itself;
    143 (128 + SIGTERM, as a terminated process) when it stopped without requeueing."""

    def __init__(self, message: str, requeued: bool):
        super().__init__(message)
        self.exit_code = 0 if requeued else 143
        self.label = "requeued" if requeued else "stopped"  # an orderly stop, not an error


def restart_count() -> int:
    """How many times SLURM has restarted this job (0 on its first run, or outside SLURM)."""
    value = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def resume_after_requeue(pipeline: Pipeline) -> Pipeline:
    """The pipeline a requeued SLURM job trains: resuming from its own out_dir's `latest`, if it wrote one.

    A first run (`SLURM_RESTART_COUNT` unset or 0) is returned unchanged, so starting over an
    existing run still needs train.resume or train.overwrite. A restarted job that wrote no
    checkpoint before it stopped starts again from the beginning, as it first did."""
    count = restart_count()
    train = pipeline.train
    latest = Path(train.out_dir) / "checkpoints" / LATEST
    if count == 0 or not latest.is_file():
        return pipeline
    if os.environ.get("SLURM_PROCID", "0") == "0":  # one line per job, not per rank
        instead = f" (instead of train.resume={train.resume})" if train.resume else ""
        print(f"SLURM restart {count} of job {os.environ.get('SLURM_JOB_ID', '?')}: resuming from "
              f"{latest.parent / latest.read_text().strip()}{instead}", file=sys.stderr, flush=True)
    return replace(pipeline, train=replace(train, resume=str(train.out_dir), overwrite=False))


def slurm_environment(pipeline: Pipeline):
    """Lightning's SLURM cluster environment for this job (None outside a SLURM job step).

    Passed explicitly because the one Lightning detects on its own has auto_requeue on with
    its mid-step hpc checkpoint (see the module docstring), even when train.slurm_requeue is off."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return None
    return SLURMEnvironment(auto_requeue=pipeline.train.slurm_requeue, requeue_signal=REQUEUE_SIGNAL)


class RequeueOnSignal(pl.Callback):
    """On SIGUSR1 (time limit near) or SIGTERM (preemption), stop every rank at the same step boundary
    with a complete checkpoint as `latest`; after SIGUSR1 rank 0 also requeues the job.

    The handlers only record the signal. The decision and the checkpoint come at the end of a step
    (`on_train_batch_end`); the stop itself at the start of the next hook, after Lightning has
    written that step's metrics (they would be lost: the resumed run starts after that step)."""

    def __init__(self, checkpoints: RollingCheckpoints):
        self.checkpoints = checkpoints
        self.received: set[int] = set()
        self._stop: tuple[str, int, str] | None = None  # reason, step, checkpoint
        self._replaced: dict[int, object] = {}
        self._group = None  # the gloo group the ranks agree over (more than one rank)

    def setup(self, trainer, pl_module, stage: str) -> None:
        # before Lightning registers its handlers: it keeps a SIGUSR1 handler that is already set
        self._replaced[REQUEUE_SIGNAL] = signal.signal(REQUEUE_SIGNAL, self._record)

    def on_train_start(self, trainer, pl_module) -> None:
        # after Lightning registered its SIGTERM handler, whose notifier runs a collective (broadcast) inside the
        # handler (Lightning PR 20825): with a peer already gone or inside another collective it fails or hangs
        # (seen here: gloo "Connection reset by peer" when the requeue's SIGTERM reached a rank in teardown)
        self._replaced[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._record)
        if trainer.world_size > 1:
            self._group = _agreement_group()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for signum, previous in self._replaced.items():
            if signal.getsignal(signum) == self._record:  # Lightning may have restored the originals already
                signal.signal(signum, previous)
        self._replaced = {}

    def _record(self, signum, frame) -> None:
        self.received.add(signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._stop is not None:
            return
        reason = self._agreed_reason(trainer, pl_module)
        if reason is not None:
            self._stop = (reason, trainer.global_step, self._checkpoint(trainer, pl_module))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stop_if_asked(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._stop_if_asked(trainer)  # the stop came at an epoch's last step

    def _stop_if_asked(self, trainer) -> None:
        if self._stop is None:
            return
        reason, step, checkpoint = self._stop
        why = "SIGTERM (preemption or scancel)" if reason == "SIGTERM" else f"{reason} before the time limit"
        if trainer.is_global_zero:
            # Said now, before the requeue and the teardown: SLURM ends the step KillWait seconds after its SIGTERM
            # (a requeue sends one), and on a loaded machine the process did not live to print its last line.
            print(f"stack train: stopped at step {step} on {why}; checkpoint {checkpoint}", file=sys.stderr, flush=True)
        if reason == "SIGTERM":
            raise TrainingRequeued(f"step {step} is checkpointed. A requeued job resumes from it by itself; otherwise "
                                   f"resume with train.resume={self.checkpoints.out_dir}", requeued=False)
        done, what = _requeue() if trainer.is_global_zero else (True, "rank 0 requeues the job")
        raise TrainingRequeued(f"step {step} is checkpointed; {what}", requeued=done)

    def _agreed_reason(self, trainer, pl_module) -> str | None:
        """'SIGUSR1'/'SIGTERM' when any rank got that signal (every rank gets the same answer), else None.

        Every step, so the stop comes at the first step boundary after the signal whatever the lead time; on a
        CPU tensor over gloo, so on GPUs it neither syncs the device nor waits for the step's queued kernels
        (a device tensor's all-reduce + `.item()` did both, every step)."""
        code = 2.0 if signal.SIGTERM in self.received else 1.0 if REQUEUE_SIGNAL in self.received else 0.0
        flag = torch.tensor([code])
        if trainer.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return {0.0: None, 1.0: signal.Signals(REQUEUE_SIGNAL).name, 2.0: "SIGTERM"}[float(flag.item())]

    def _checkpoint(self, trainer, pl_module) -> str:
        """This step's checkpoint, complete and `latest` on disk (the periodic one may be in flight at this step)."""
        if self.checkpoints._saved_step != trainer.global_step:
            self.checkpoints.save(trainer, pl_module, blocking=True)
        self.checkpoints.wait()
        trainer.strategy.barrier("preemption-checkpoint")
        return str(pl_module.last_good_checkpoint)


def _agreement_group():
    """A gloo process group over every rank (called by every rank, at train start): the default group of a GPU
    run is NCCL, whose collectives take device tensors."""
    if dist.get_backend() == "gloo":
        return None  # the default group already runs on the CPU
    return dist.new_group(backend="gloo")


def _requeue() -> tuple[bool, str]:
    """`scontrol requeue` this job (rank 0, after the checkpoint is complete): whether it worked, and what
    happened, for the message."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        return False, f"not requeued: SLURM_JOB_ID is {job!r}, not a job id. Resubmit the job to resume from it"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`scontrol requeue {job}` failed ({exc}). Resubmit the job to resume from it"
    if result.returncode != 0:
        return False, (f"`scontrol requeue {job}` failed: {(result.stderr or result.stdout).strip()[:300]}. "
                "Resubmit the job (it resumes from this checkpoint)")
    return True, f"requeued SLURM job {job}, which resumes from it when it starts again"
