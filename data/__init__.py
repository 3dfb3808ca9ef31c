"""stack.data: the rendered driving world, WebDataset shards, and the torch/DALI loaders.

- `stack data make` (`make.py`) renders the procedural world (`world/`: town, traffic,
  renderer; `stack drive` steps the same world in closed loop) into versioned WebDataset
  shards (`format.py` documents the schema).
- `build_loader(pipeline, split, rank=None, world_size=None, shuffle=None, augment=None)`
  returns an iterable of `stack.batch.Batch` with `len()` (the same on every rank), from the
  `torch` backend (`loader.py`) or the `dali` backend (`dali_loader.py`) per `data.backend`.

Importing this package is cheap; the loaders import torch when first used.
"""


def build_loader(pipeline, split, rank=None, world_size=None, shuffle=None, augment=None, pin_memory=False):
    """See `stack.data.loader.build_loader`."""
    from stack.data.loader import build_loader as build

    return build(pipeline, split, rank=rank, world_size=world_size, shuffle=shuffle, augment=augment,
                 pin_memory=pin_memory)
