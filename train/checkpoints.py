"""Resumable checkpoints that an interrupted write can never corrupt.

Every `train.checkpoint_every_n_steps` (and when fitting ends) the full training state
— model, optimizer, LR schedule, step, loop and loader position, RNG, and the
resolved pipeline — is written to a temporary name beside the target and renamed
into place only when every rank has finished writing. Under FSDP2 the checkpoint is
a folder of shards (torch.distributed.checkpoint, one file per rank); otherwise one
`.ckpt` file. `checkpoints/latest` names the newest complete checkpoint and is itself
replaced atomically; only then are checkpoints beyond `train.keep_checkpoints`
deleted. A crash at any moment leaves the previous checkpoint and `latest` intact.

When fitting ends, rank 0 also writes `model.pt` — the full network weights with the
pipeline (`stack.checkpoint.save_model_checkpoint`) — which `stack export` and
`stack eval` read on any number of devices.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning.pytorch as pl

from stack.errors import StackError

LATEST = "latest"


class RollingCheckpoints(pl.Callback):
    """Atomic resumable checkpoints every `every` steps, keeping the newest `keep`."""

    def __init__(self, out_dir: str | Path, every: int, keep: int):
        self.out_dir = Path(out_dir)
        self.directory = self.out_dir / "checkpoints"
        self.every, self.keep = every, keep
        self._saved_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0 and trainer.global_step != self._saved_step:
            self.save(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._saved_step:
            self.save(trainer, pl_module)
        self._write_model_weights(trainer, pl_module)

    def save(self, trainer, pl_module) -> Path:
        final = self.directory / f"step-{trainer.global_step:07d}.ckpt"
        temp = self.directory / f".{final.name}.partial"
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            _remove(temp)
        trainer.strategy.barrier("checkpoint-start")
        trainer.save_checkpoint(temp)  # collective: every rank writes its part
        trainer.strategy.barrier("checkpoint-written")
        if trainer.is_global_zero:
            _remove(final)
            os.replace(temp, final)
            _write_atomically(self.directory / LATEST, final.name + "\n")
            self._prune(final)
        trainer.strategy.barrier("checkpoint-done")
        self._saved_step = trainer.global_step
        pl_module.last_good_checkpoint = str(final)
        return final

    def _prune(self, newest: Path) -> None:
        done = sorted(p for p in self.directory.glob("step-*.ckpt") if p != newest)
        for old in done[: max(0, len(done) - (self.keep - 1))]:
            _remove(old)

    def _write_model_weights(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from stack.checkpoint import save_model_checkpoint

        model = pl_module.model
        if pl_module.sharded_units:  # collective: gathers the full weights onto rank 0's CPU
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = model.state_dict()
        if trainer.is_global_zero:
            save_model_checkpoint(self.out_dir / "model.pt", pl_module.pipeline, state,
                                  extra={"global_step": trainer.global_step, "epoch": trainer.current_epoch})


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(text)
    os.replace(temp, path)


def resolve_resume(path: str | Path) -> Path:
    """The checkpoint `train.resume` points at: a `.ckpt` file or shard folder, or a run folder's latest."""
    path = Path(path)
    for folder in (path, path / "checkpoints"):
        pointer = folder / LATEST
        if pointer.is_file():
            return folder / pointer.read_text().strip()
    if path.is_file() or (path.is_dir() and (path / "meta.pt").is_file()):
        return path
    raise StackError(
        f"train.resume={str(path)!r}: expected a checkpoint (`step-*.ckpt` file or sharded folder) or a run "
        f"folder with checkpoints/{LATEST}; {'found a folder without either' if path.exists() else 'nothing is there'}. "
        f"Point it at a train.out_dir or one of its checkpoints/step-*.ckpt.")
