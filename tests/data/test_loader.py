"""The torch loader: Batch contract, rank/worker sharding (no duplicates, equal lengths), augmentation."""

import math

import numpy as np
import pytest
import torch

from stack.data import build_loader
from stack.data.sharding import batches_per_rank, locate, rank_samples, worker_quotas, worker_samples


def _plan(counts, rank, world_size, workers, batch, drop_last, **epoch):
    """[(shard, index)] of every worker of `rank`, worker by worker."""
    shards = [(f"s{i}", n) for i, n in enumerate(counts)]
    ids = rank_samples(sum(counts), rank, world_size, batch, drop_last, **epoch)
    return [locate(shards, worker_samples(ids, worker, max(workers, 1), batch)) for worker in range(max(workers, 1))]


@pytest.mark.parametrize("counts", [[32, 32, 32, 7], [5], [3, 3, 3, 3, 3], [64, 1, 64]])
@pytest.mark.parametrize("world_size,workers,batch", [(1, 0, 4), (2, 2, 4), (3, 2, 2), (4, 3, 1)])
def test_training_plan_has_no_duplicates_and_equal_batches_per_rank(counts, world_size, workers, batch):
    total, seen, batches = sum(counts), [], []
    for rank in range(world_size):
        per_worker = _plan(counts, rank, world_size, workers, batch, True, epoch=3, seed=1, shuffle=True)
        assert all(len(samples) % batch == 0 for samples in per_worker)
        assert [len(samples) for samples in per_worker] == worker_quotas(total, world_size, workers, batch, True)
        batches.append(sum(len(samples) for samples in per_worker) // batch)
        seen += [sample for samples in per_worker for sample in samples]
    assert len(set(batches)) == 1 and batches[0] == batches_per_rank(total, world_size, workers, batch, True)
    assert len(seen) == len(set(seen)), "a sample is read twice in one epoch"
    assert len(seen) > total - world_size * batch  # only the tail is dropped


@pytest.mark.parametrize("world_size,workers", [(1, 1), (2, 2), (3, 1)])
def test_evaluation_plan_reads_every_sample_with_equal_counts(world_size, workers):
    counts = [5, 3, 6]
    seen, per_rank = set(), []
    for rank in range(world_size):
        samples = [s for worker in _plan(counts, rank, world_size, workers, 4, False) for s in worker]
        per_rank.append(len(samples))
        seen |= set(samples)
    assert len(set(per_rank)) == 1 and per_rank[0] == math.ceil(14 / world_size)
    assert seen == {(f"s{i}", j) for i, n in enumerate(counts) for j in range(n)}


def test_loader_yields_batches_that_match_the_pipeline(dataset):
    pipeline, _ = dataset
    loader = build_loader(pipeline, "train", rank=0, world_size=1)
    batches = list(loader)
    assert len(batches) == len(loader) > 0
    for batch in batches:
        assert batch.mismatches(pipeline) == []
        assert (batch.box_labels >= -1).all() and (batch.box_labels < len(pipeline.model.detection_classes)).all()
        semantic = batch.semantic[batch.semantic != 255]
        assert semantic.max() < len(pipeline.model.segmentation_classes)


def _fingerprints(loader):
    return [tuple(np.round(torch.cat([b.past_trajectory[i].flatten(), b.ego_status[i]]).numpy(), 4))
            for b in loader for i in range(len(b.command))]


def test_ranks_and_workers_split_the_data_without_duplicates(dataset, small_pipeline):
    pipeline, _ = dataset
    everything = _fingerprints(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False))
    two_workers = small_pipeline(pipeline.data.root, "data.num_workers=2", "data.batch_size=1")
    per_rank = [build_loader(two_workers, "train", rank, 2, shuffle=True, augment=False) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    seen = [fp for loader in per_rank for fp in _fingerprints(loader)]
    assert len(seen) == len(set(seen)) == 2 * len(per_rank[0])
    assert set(seen) <= set(everything)


def test_validation_without_augmentation_is_deterministic(dataset):
    pipeline, _ = dataset
    first = list(build_loader(pipeline, "val", 0, 1))
    second = list(build_loader(pipeline, "val", 0, 1))
    for a, b in zip(first, second):
        assert torch.equal(a.images, b.images) and torch.equal(a.boxes, b.boxes)


def test_rank_and_world_size_come_from_the_environment(dataset, monkeypatch):
    pipeline, _ = dataset
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = build_loader(pipeline, "val")
    assert (loader.rank, loader.world_size) == (1, 2)
    explicit = build_loader(pipeline, "val", rank=0, world_size=1)
    assert len(explicit) >= len(loader)


def test_each_iteration_is_a_new_shuffled_epoch(dataset, small_pipeline):
    pipeline, _ = dataset
    loader = build_loader(small_pipeline(pipeline.data.root, "data.batch_size=1"), "train", 0, 1, augment=False)
    orders = [_fingerprints(loader) for _ in range(3)]
    assert all(sorted(order) == sorted(orders[0]) for order in orders)
    assert len({tuple(order) for order in orders}) > 1
    loader.set_epoch(5)
    first = _fingerprints(loader)
    loader.set_epoch(5)
    assert _fingerprints(loader) == first


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_lightning_fits_on_either_backend_for_len_batches_per_epoch(dataset, small_pipeline, backend):
    lightning = pytest.importorskip("lightning")
    pipeline, _ = dataset
    loader = build_loader(small_pipeline(pipeline.data.root, f"data.backend={backend}"), "train", augment=False)

    class Probe(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer, self.samples = torch.nn.Linear(3, 1), 0

        def training_step(self, batch, index):
            self.samples += batch.images.shape[0]
            return self.layer(batch.images.float().mean(dim=(1, 3, 4))).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def transfer_batch_to_device(self, batch, device, index):
            return batch.to(device)

    probe = Probe()
    trainer = lightning.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(probe, train_dataloaders=loader)
    assert trainer.global_step == 2 * len(loader)
    assert probe.samples == 2 * len(loader) * pipeline.data.batch_size


def test_read_npy_matches_np_load_and_refuses_what_it_refuses():
    import io

    from stack.data.samples import read_npy

    def saved(array, **options):
        buffer = io.BytesIO()
        np.save(buffer, array, **options)
        return buffer.getvalue()

    for array in (np.arange(60, dtype=np.float16).reshape(3, 4, 5), np.zeros((0, 10), np.float32),
                  np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.array([2], np.int64), np.ones((2, 2), bool)):
        data = saved(array)
        assert np.array_equal(read_npy(data), np.load(io.BytesIO(data))) and read_npy(data).dtype == array.dtype
    good = saved(np.zeros((40, 10), np.float32))
    for bad in (good[:-4], good[:30], b"not an npy at all", saved(np.array([{}, 1], dtype=object))):
        with pytest.raises(ValueError):
            read_npy(bad)


def test_persistent_workers_follow_the_epoch_and_survive_an_abandoned_one(dataset, small_pipeline):
    """The workers fork once per loader; each epoch is the one set last, even after an epoch left after one batch."""
    pipeline, _ = dataset
    two = small_pipeline(pipeline.data.root, "data.num_workers=2", "data.batch_size=1")
    loader = build_loader(two, "train", 0, 1, augment=False)
    loader.set_epoch(1)
    next(iter(loader))
    loader.set_epoch(3)
    epoch_three = _fingerprints(loader)
    fresh = build_loader(two, "train", 0, 1, augment=False)
    fresh.set_epoch(3)
    assert epoch_three == _fingerprints(fresh)
    loader.set_epoch(4)
    assert _fingerprints(loader) != epoch_three and sorted(_fingerprints(loader)) == sorted(epoch_three)


@pytest.mark.gpu
def test_batches_for_a_gpu_come_in_page_locked_memory(dataset):
    """The trainer on a GPU asks for pinned batches: their copy to the device is then asynchronous, where a pageable
    one blocked the host for 7.3 ms a step on the default preset
    (docs/log/2026-11-28_default-preset-temporal-h200.md)."""
    pipeline, _ = dataset
    pinned = next(iter(build_loader(pipeline, "train", rank=0, world_size=1, pin_memory=True)))
    plain = next(iter(build_loader(pipeline, "train", rank=0, world_size=1)))
    assert all(tensor.is_pinned() for tensor in pinned.tensors().values())
    assert not any(tensor.is_pinned() for tensor in plain.tensors().values())
    assert all(torch.equal(pinned.tensors()[name], tensor) for name, tensor in plain.tensors().items())
