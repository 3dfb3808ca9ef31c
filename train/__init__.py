"""stack.train: Lightning training (DDP/FSDP2, bf16), checkpoints, observability, launchers."""
