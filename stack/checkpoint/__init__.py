"""Checkpoint formats: the file deploy starts from, and the resumable state training writes.

- `model_file`: `model.pt`, the contract between `stack train` and everything after it (eval, export,
  deploy, drive): weights plus the resolved pipeline, its hash and data lineage; read without unpickling
  (`weights_only`), refused with what to do when it does not fit the network it names.
- `sharded`: torch.distributed.checkpoint (DCP) folders written while training runs on (`dcp.async_save`),
  one format for 1 rank, DDP and FSDP2; a restricted reader for DCP's pickled metadata; fsync'd and renamed
  into place before it becomes `latest`.

`model_file` and `sharded` need only torch. The Lightning side (when to checkpoint, staging the full training
state, resume, pruning, the non-finite check before a save) is `stack.train.checkpoints`: only training uses
it, and this base layer never imports Lightning (tests/stack/test_layering.py).
"""
