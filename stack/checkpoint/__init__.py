"""Checkpoints, in one place: the file deploy starts from, and the resumable state training writes.

- `model_file`: `model.pt`, the contract between `stack train` and everything after it (eval, export,
  deploy, drive): weights plus the resolved pipeline, its hash and data lineage; read without unpickling
  (`weights_only`), refused with what to do when it does not fit the network it names.
- `sharded`: torch.distributed.checkpoint (DCP) folders written while training runs on (`dcp.async_save`),
  one format for 1 rank, DDP and FSDP2; a restricted reader for DCP's pickled metadata; fsync'd and renamed
  into place before it becomes `latest`.
- `training`: the Lightning side: when to checkpoint, staging the full training state (model, AdamW,
  schedule, loader position, RNG, pipeline), resume, pruning, and the non-finite check before a save.

`model_file` and `sharded` need only torch; `training` imports Lightning and is used by `stack.train` alone.
"""
