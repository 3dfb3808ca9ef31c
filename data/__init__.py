"""stack.data: the rendered driving world, WebDataset shards, and the torch/DALI loaders."""
