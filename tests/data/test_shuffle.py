"""The training shuffle: a global, seeded permutation per epoch, the same on both backends, split disjointly by rank."""

import numpy as np
import pytest
import torch

from stack.data import build_loader
from stack.data.sharding import rank_samples

FRAMES, SCENES = 6, 38
"""The tiny preset's train split: 38 scenes of 6 consecutive frames, stored scene by scene."""


def _same_scene_neighbours(ids) -> float:
    scenes = np.asarray(ids) // FRAMES
    return float(np.mean(scenes[1:] == scenes[:-1]))


def test_adjacent_samples_come_from_different_scenes_as_often_as_in_a_random_permutation():
    total = FRAMES * SCENES
    fractions = [_same_scene_neighbours(rank_samples(total, 0, 1, 4, True, epoch, 0, True)) for epoch in range(30)]
    random = (FRAMES - 1) / (total - 1)  # a uniform permutation's expectation
    assert abs(np.mean(fractions) - random) < 0.01
    stored = _same_scene_neighbours(rank_samples(total, 0, 1, 4, True, 0, 0, False))
    assert stored > 0.8 and np.mean(fractions) < stored / 20  # stored order: runs of one scene


def test_the_permutation_changes_per_epoch_and_is_fixed_by_the_seed():
    total = FRAMES * SCENES
    orders = [tuple(rank_samples(total, 0, 1, 4, True, epoch, seed=7, shuffle=True)) for epoch in range(4)]
    assert len(set(orders)) == 4
    assert orders[2] == tuple(rank_samples(total, 0, 1, 4, True, 2, seed=7, shuffle=True))
    assert orders[2] != tuple(rank_samples(total, 0, 1, 4, True, 2, seed=8, shuffle=True))


@pytest.mark.parametrize("world_size,batch", [(2, 4), (3, 2), (4, 1), (8, 4)])
def test_ranks_take_disjoint_equal_slices_of_one_permutation(world_size, batch):
    total = FRAMES * SCENES
    slices = [rank_samples(total, rank, world_size, batch, True, 5, 1, True) for rank in range(world_size)]
    assert len({len(s) for s in slices}) == 1 and len(slices[0]) % batch == 0
    seen = np.concatenate(slices)
    assert len(seen) == len(set(seen.tolist())) > total - world_size * batch
    for share in slices:  # each rank draws from all over the split, not a contiguous run of scenes
        assert len(set((share // FRAMES).tolist())) > min(len(share), SCENES) // 2
    evaluation = np.concatenate([rank_samples(total, rank, world_size, batch, False) for rank in range(world_size)])
    assert set(evaluation.tolist()) == set(range(total))


def _fingerprints(batches):
    return [tuple(np.round(torch.cat([b.past_trajectory[i].flatten(), b.ego_status[i]]).numpy(), 4))
            for b in batches for i in range(len(b.command))]


def test_both_backends_read_the_planned_permutation_in_the_same_order(dataset, small_pipeline):
    """torch with 2 workers and DALI yield the same samples in the same order: the plan's, for the seed and epoch."""
    pipeline, _ = dataset
    stored = _fingerprints(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False))
    orders = {}
    for backend, workers in (("torch", 2), ("dali", 2)):
        chosen = small_pipeline(pipeline.data.root, f"data.backend={backend}", f"data.num_workers={workers}",
                                "data.batch_size=1", "train.seed=3")
        loader = build_loader(chosen, "train", 0, 1, augment=False)
        orders[backend] = []
        for epoch in (4, 5):
            loader.set_epoch(epoch)
            orders[backend].append(_fingerprints(loader))
    planned = [[stored[i] for i in rank_samples(len(stored), 0, 1, 1, True, epoch, 3, True)] for epoch in (4, 5)]
    assert orders["torch"] == orders["dali"] == planned
    assert planned[0] != planned[1]
