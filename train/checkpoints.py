"""Resumable checkpoints that an interrupted write can never corrupt: the Lightning side (callback, resume reader).

It lives in `stack.train` because only training uses it and it needs Lightning; the formats it writes and reads
(`stack.checkpoint.sharded`, `stack.checkpoint.model_file`) need only torch, so deploy and eval read them without it.

Every `train.checkpoint_every_n_steps` (and when fitting ends) the full training state
— model, optimizer, LR schedule, step, loop and loader position, RNG, and the
resolved pipeline — is staged into CPU memory and written in the background while
training continues (`stack.checkpoint.sharded`: torch.distributed.checkpoint, one folder of
shards for any number of ranks, DDP or FSDP2). The folder is written under a temporary
name and renamed into place only once every file is durable; `checkpoints/latest` then
names it (replaced atomically), and only then are checkpoints beyond
`train.keep_checkpoints` deleted. A crash at any moment, also mid-write, leaves the
previous checkpoint and `latest` intact.

When fitting ends, rank 0 also writes `model.pt` — the full network weights with the
pipeline (`stack.checkpoint.model_file.save_model_checkpoint`) — which `stack export` and
`stack eval` read on any number of devices.

A checkpoint is written only if every weight and optimizer-state tensor is finite (every
rank agrees): the loss guard runs before the optimizer step, so an update that makes the
weights NaN/Inf would otherwise be saved and named "last good". `check_resume` refuses,
before Lightning starts, a checkpoint that cannot be read (truncated, garbage, a `latest`
naming a missing file) or whose network differs in shape from the one being trained,
and `prepare_out_dir` refuses to start a fresh run over an earlier one unless asked.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from stack.errors import StackError
from stack.checkpoint.sharded import (LATEST, AsyncCheckpointWriter, CheckpointWriteFailed, load_sharded_checkpoint,
                                      read_checkpoint_safely)

__all__ = ["LATEST", "RollingCheckpoints", "ShardedCheckpointIO", "check_resume", "prepare_out_dir", "resolve_resume"]
RUN_OUTPUTS = ("checkpoints", "model.pt", "csv", "tensorboard", "pipeline.yaml")
"""What a run writes under train.out_dir (and what train.overwrite=true deletes)."""


class ShardedCheckpointIO(TorchCheckpointIO):
    """Lightning's resume reader for 1 rank and DDP: a checkpoint folder is read through DCP (FSDP2's
    ModelParallelStrategy reads the same folder itself, into its shards); a single `.ckpt` file weights-only."""

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        if Path(path).is_dir():
            return load_sharded_checkpoint(Path(path))
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


class RollingCheckpoints(pl.Callback):
    """Atomic resumable checkpoints every `every` steps, keeping the newest `keep`, written while training runs on.

    `save` and `wait` are also what a preemption handler calls: `save(trainer, module, blocking=True)` returns once
    the checkpoint is `latest`. Both are collective (every rank calls them at the same step). `blocking=True` makes
    every periodic checkpoint synchronous too (`stack bench checkpoint` times the loop both ways)."""

    def __init__(self, out_dir: str | Path, every: int, keep: int, blocking: bool = False):
        self.out_dir = Path(out_dir)
        self.directory = self.out_dir / "checkpoints"
        self.every, self.keep, self.blocking = every, keep, blocking
        self._saved_step = -1
        self.writer = AsyncCheckpointWriter(self.directory, keep)
        self._module = None  # the LightningModule whose last_good_checkpoint names the newest good checkpoint
        self._committed: str | None = None  # the newest checkpoint known complete

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.writer.use_own_process_group()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0 and trainer.global_step != self._saved_step:
            self.save(trainer, pl_module, blocking=self.blocking)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._saved_step:
            self.save(trainer, pl_module, blocking=True)
        self.wait()
        self.write_model_weights(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Ctrl-C or an error: let the write in flight finish (it becomes `latest` if it completes)."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the original exception is the one to report
            print(f"checkpoint write in flight failed too: {exc}", file=sys.stderr)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.writer.wait(raise_errors=False)

    def wait(self) -> None:
        """Finish any checkpoint write still in flight; on rank 0 it is then `latest`."""
        try:
            done = self.writer.wait()
        except CheckpointWriteFailed:
            if self._module is not None:
                self._module.last_good_checkpoint = self._committed
            raise
        if done is not None:
            self._committed = str(done)

    def save(self, trainer, pl_module, blocking: bool = False) -> Path:
        """Checkpoint the training state at this step: stage it to CPU memory and write it in the background
        (after the previous write has finished). `blocking=True` returns only once it is `latest` on disk
        (what a preemption handler needs before the process exits)."""
        self._module = pl_module
        self.wait()
        _stop_unless_finite(trainer, pl_module)
        if trainer.is_global_zero:
            self.writer.clear_partial(trainer.global_step)
        trainer.strategy.barrier("checkpoint-start")
        with ctrl_c_deferred():
            # weights_only=False: the full training state (optimizer, schedule, loops) that resume needs
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            final = self.writer.start(checkpoint, trainer.global_step, trainer.is_global_zero)
            self._saved_step = trainer.global_step
            # finite, staged and being written: an error from here on waits for it (on_exception) before reporting it
            pl_module.last_good_checkpoint = str(final)
        if blocking:
            self.wait()
            trainer.strategy.barrier("checkpoint-done")
        return final

    def write_model_weights(self, trainer, pl_module) -> None:
        """model.pt: the full network weights with the pipeline that built them (collective under FSDP2)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from stack.checkpoint.model_file import save_model_checkpoint

        model = pl_module.model
        if pl_module.sharded_units:  # collective: gathers the full weights onto rank 0's CPU
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = model.state_dict()
        if trainer.is_global_zero:
            save_model_checkpoint(self.out_dir / "model.pt", pl_module.pipeline, state,
                                  extra={"global_step": trainer.global_step, "epoch": trainer.current_epoch})


@contextmanager
def ctrl_c_deferred():
    """Hold a Ctrl-C that arrives while the training state is being dumped and staged, and raise it after.

    A KeyboardInterrupt raised between two bytecodes of Lightning's `dump_checkpoint` can land inside
    OmegaConf's structured-config code (the pipeline goes into the checkpoint), which turns it into an
    unrelated AttributeError: the run then died as a crash (exit 1) instead of stopping with exit 130 and
    naming its last checkpoint. Only the main thread may set handlers, and a handler the user or another
    callback installed is left alone."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _stop_unless_finite(trainer, pl_module) -> None:
    """Raise TrainingDiverged (naming the previous checkpoint) if any weight or optimizer state is NaN/Inf."""
    from stack.train.module import TrainingDiverged

    bad = _first_non_finite(pl_module.model.named_parameters(), "weight")
    for optimizer in trainer.optimizers:
        states = ((f"{name} of a parameter", value) for state in optimizer.state.values()
                  for name, value in state.items())
        bad = bad or _first_non_finite(states, "optimizer state")
    flag = torch.tensor([1.0 if bad else 0.0], device=pl_module.device)
    if trainer.world_size > 1:  # every rank stops together
        flag = trainer.strategy.reduce(flag, reduce_op="max")
    if not flag.item():
        return
    kept = pl_module.last_good_checkpoint or "none was written yet"
    raise TrainingDiverged(
        f"training diverged at step {trainer.global_step}: {bad or 'a weight on another rank'} is not finite after the "
        f"optimizer step, so no checkpoint was written. Last good checkpoint (finite weights): {kept}. Lower "
        "train.lr, raise train.warmup_steps or set train.grad_clip, then resume with train.resume=<that checkpoint>.")


def _first_non_finite(named_tensors, what: str) -> str:
    for name, value in named_tensors:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if hasattr(value, "to_local") else value
            if not torch.isfinite(local).all():
                return f"{what} {name}"
    return ""


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def resolve_resume(path: str | Path) -> Path:
    """The checkpoint `train.resume` points at: a `.ckpt` file or shard folder, or a run folder's latest."""
    path = Path(path)
    for folder in (path, path / "checkpoints"):
        pointer = folder / LATEST
        if pointer.is_file():
            named = folder / pointer.read_text().strip()
            if not named.exists():
                others = sorted(p.name for p in folder.glob("step-*.ckpt"))
                raise StackError(
                    f"train.resume={str(path)!r}: {pointer} names {named.name}, which does not exist "
                    f"(checkpoints there: {', '.join(others) or 'none'}); point train.resume at one of them")
            return named
    if path.is_file() or (path.is_dir() and (path / "meta.pt").is_file()):
        return path
    raise StackError(
        f"train.resume={str(path)!r}: expected a checkpoint (`step-*.ckpt` file or sharded folder) or a run "
        f"folder with checkpoints/{LATEST}; {'found a folder without either' if path.exists() else 'nothing is there'}. "
        f"Point it at a train.out_dir or one of its checkpoints/step-*.ckpt.")


def prepare_out_dir(pipeline, rank_zero: bool) -> None:
    """Refuse to start a fresh run in an out_dir that holds an earlier one (model.pt or checkpoints),
    unless train.resume continues it or train.overwrite=true asks to delete it (done here, on rank 0)."""
    train = pipeline.train
    out = Path(train.out_dir)
    found = [name for name in ("model.pt", "checkpoints") if (out / name).exists()
             and (name != "checkpoints" or any((out / name).iterdir()))]
    if not found or (train.resume and _inside(Path(train.resume), out)):
        return  # continuing the run that is there
    if train.resume and not train.overwrite:
        raise StackError(
            f"train.resume={train.resume!r} continues another run, but train.out_dir={str(out)!r} already holds one "
            f"({' and '.join(found)}) that it would overwrite. Resume into an empty train.out_dir, or into the run's "
            f"own folder, or pass train.overwrite=true to replace what is in {out}")
    if not train.overwrite:
        raise StackError(
            f"train.out_dir={str(out)!r} already holds a run ({' and '.join(found)}); a fresh run would overwrite it. "
            f"Continue it with train.resume={out}, start fresh there with train.overwrite=true (deletes its "
            "checkpoints, model.pt and logs), or choose another train.out_dir")
    if rank_zero:
        for name in RUN_OUTPUTS:
            _remove(out / name)


def out_dir_lock(pipeline, rank_zero: bool):
    """The writer lock on train.out_dir, held by rank 0 while the run lasts (`stack.locks`): a second `stack train`
    into the same folder while one runs is refused (exit 2) before it changes anything."""
    from contextlib import nullcontext

    from stack.locks import folder_lock

    out = Path(pipeline.train.out_dir)
    if not rank_zero:
        return nullcontext()
    return folder_lock(out, f"another `stack train` is writing train.out_dir={str(out)!r}; two runs there would mix "
                            "their metrics and checkpoints. Wait for it to finish, or choose another train.out_dir")


def _inside(path: Path, folder: Path) -> bool:
    """True when `path` is `folder` or lies under it (symlinks and `..` resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def read_resume_checkpoint(path: Path) -> dict:
    """The training state at `path` (`.ckpt` file, or a sharded folder's meta.pt), loaded with weights_only=True;
    a truncated, garbage or unsafe file is a StackError naming it. A folder is read whole (every shard), which
    also checks each of its files before Lightning reads them."""
    if path.is_dir():
        return read_checkpoint_safely(path)
    source = path
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read is the same answer to the user
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StackError(f"train.resume: {source} is not a readable training checkpoint ({detail[:300]}); it is "
                         "truncated, corrupt or not written by `stack train`. Resume from another checkpoint in "
                         "its folder, or start fresh without train.resume") from exc
    if not isinstance(state, dict) or "global_step" not in state:
        raise StackError(f"train.resume: {source} holds no training state (global_step missing); resume from a "
                         "checkpoints/step-*.ckpt that `stack train` wrote")
    return state


def check_resume(path: Path, pipeline, model: torch.nn.Module) -> dict:
    """Refuse a checkpoint whose network does not fit `model` (built from the current pipeline), naming the
    pipeline keys that differ (checkpoint value vs current value). Returns the checkpoint's training state."""
    state = read_resume_checkpoint(path)
    differ = _differing_model_keys(state.get("pipeline_yaml"), pipeline, str(path))
    weights = state.get("state_dict")
    if isinstance(weights, dict):  # every tensor whole, also from a sharded checkpoint
        current = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
        stored = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
        shapes = [f"{k}: {stored.get(k)} vs {current.get(k)}" for k in sorted(set(current) | set(stored))
                  if stored.get(k) != current.get(k)]
    else:
        shapes = ["(no weights in the checkpoint)"] if differ else []
    if shapes:
        keys = "; ".join(differ) or "no model.* key (the network code changed)"
        raise StackError(
            f"train.resume: {path} holds a network of another shape than this pipeline builds. Pipeline keys that "
            f"differ (checkpoint vs current): {keys}. Weights that differ: {'; '.join(shapes[:5])}"
            f"{' …' if len(shapes) > 5 else ''}. Set those keys back to the checkpoint's values to resume, or start "
            "fresh without train.resume")
    return state


def _differing_model_keys(pipeline_yaml, pipeline, source: str) -> list[str]:
    """'key: checkpoint value vs current value' for every key that shapes the network (`stack.checkpoint.model_file.MODEL_SECTIONS`)."""
    from stack.checkpoint.model_file import model_differences
    from stack.config import pipeline_from_yaml

    if not isinstance(pipeline_yaml, str):
        return []
    try:
        stored = pipeline_from_yaml(pipeline_yaml, source)
    except StackError:
        return []
    return [f"{key}: {before!r} vs {after!r}" for key, before, after in model_differences(stored, pipeline)]
