"""Resumable training data: a loader that knows its epoch and how far into it training got.

Each rank's loader yields the same number of batches per epoch in an order fixed by
(seed, epoch), so a position is just (epoch, batches consumed). The trainer records
that position with every checkpoint (Lightning saves `state_dict()` of stateful
loaders); on resume the epoch is rebuilt and the consumed batches are skipped, so
training continues on exactly the batches it would have seen. Skipping still reads
them: that is as far as a streaming (WebDataset/DALI) loader allows.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import lightning.pytorch as pl

LoaderFactory = Callable[[str, int, int], object]
"""(split, rank, world_size) -> iterable of batches for that rank (training: a ResumableLoader)."""


class _EpochSetter:
    """Lightning calls `sampler.set_epoch(epoch)` on a loader's sampler before every epoch."""

    def __init__(self, loader: "ResumableLoader"):
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.epoch = epoch


class ResumableLoader:
    """Iterable over one epoch of batches from `make_epoch(epoch)`, with `state_dict` / `load_state_dict`."""

    def __init__(self, make_epoch: Callable[[int], Iterable], batches_per_epoch: int):
        self.make_epoch = make_epoch
        self.batches_per_epoch = batches_per_epoch
        self.epoch = 0
        self.position = 0
        self._skip = 0
        self.sampler = _EpochSetter(self)
        self.batch_sampler = None  # Lightning inspects loaders for one

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator:
        return self._run()

    def _run(self) -> Iterator:
        epoch, skip = self.epoch, self._skip  # read when iteration starts, after Lightning's set_epoch
        self._skip = 0
        for index, batch in enumerate(self.make_epoch(epoch)):
            if index >= self.batches_per_epoch:
                break
            if index >= skip:
                yield batch

    def mark(self, epoch: int, position: int) -> None:
        """Record that training finished `position` batches of `epoch` (called after each step)."""
        self.epoch, self.position = epoch, position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._skip = self.position if self.position < self.batches_per_epoch else 0


class PipelineData(pl.LightningDataModule):
    """The pipeline's train/val loaders for this rank, built once the strategy knows the rank."""

    def __init__(self, pipeline, loaders: LoaderFactory | None = None):
        super().__init__()
        self.pipeline = pipeline
        self.make = loaders or _stack_data_loader(pipeline)
        self._loaders: dict = {}

    def loader(self, split: str):
        if split not in self._loaders:
            self._loaders[split] = self.make(split, self.trainer.global_rank, self.trainer.world_size)
        return self._loaders[split]

    def train_dataloader(self):
        return self.loader("train")

    def val_dataloader(self):
        return self.loader("val")

    def batches_per_epoch(self) -> int | None:
        loader = self.loader("train")
        return len(loader) if hasattr(loader, "__len__") else None


def _stack_data_loader(pipeline) -> LoaderFactory:
    def make(split: str, rank: int, world_size: int):
        return pipeline_loader(pipeline, split, rank, world_size)
    return make


def pipeline_loader(pipeline, split: str, rank: int, world_size: int) -> ResumableLoader:
    """The `stack.data` loader for `split` on this rank, as a `ResumableLoader`."""
    from stack.data import build_loader
    from stack.train.parallel import accelerator_name

    loader = build_loader(pipeline, split, rank=rank, world_size=world_size,
                          pin_memory=accelerator_name(pipeline.train) == "gpu")

    def make_epoch(epoch: int):
        loader.set_epoch(epoch)  # the sample order and augmentation follow (seed, epoch)
        return loader

    return ResumableLoader(make_epoch, len(loader))
