"""The LightningModule: any multi-task network with the `stack.models` contract, trained with AdamW.

The contract the trainer relies on (and nothing more): `model.forward_batch(batch)` (or
`model(batch)`) -> dict of named outputs, and `model.loss(outputs, batch) -> dict` of named loss terms including
`total`. Everything about distribution (DDP, FSDP2), precision and checkpoints stays
here and in `stack.train.parallel`, so models stay plain `nn.Module`s.

A non-finite loss term or gradient norm stops the run with `TrainingDiverged`,
naming the step and the term; every rank agrees before stopping, so no rank is left
waiting in a collective, and no checkpoint is written after the bad step. Weights that
an update itself turns non-finite are caught before the next checkpoint is written
(`stack.train.checkpoints`), so the checkpoint named "last good" always has finite weights.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import nn

from stack.errors import StackError
from stack.failpoints import fail_point
from stack.pipeline import Pipeline
from stack.train.parallel import apply_activation_checkpointing, apply_fsdp


class TrainingDiverged(StackError):
    """A loss term or the gradient became NaN/Inf; the last good checkpoint is kept."""

    exit_code = 3


def build_adamw(params, lr: float, sharded: bool = False) -> torch.optim.AdamW:
    """AdamW as `stack train` steps it: the fused kernel (one pass over each tensor's parameter, gradient and
    moments) for plain tensors; the multi-tensor (`foreach`) kernel for FSDP2's sharded DTensors. On 2 CPU cores
    the fused step takes a third of the foreach one (`stack bench train-step`; docs/results/training.md)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), **({"foreach": True} if sharded else {"fused": True}))


class TrainModule(pl.LightningModule):
    """Wraps `model` (built from the pipeline when not given) for Lightning."""

    def __init__(self, pipeline: Pipeline, model: nn.Module | None = None):
        super().__init__()
        self.pipeline = pipeline
        if model is None:
            from stack.models import build_model

            model = build_model(pipeline)
        self.model = model
        self.sharded_units: list[str] = []
        self.checkpointed_units: list[str] = []
        self.last_good_checkpoint: str | None = None
        self._parallel_applied = False
        self._pipeline_text: tuple[object, str, str] | None = None  # (pipeline, its YAML, its hash), made once

    # ---------------------------------------------------------------- setup

    def configure_model(self) -> None:
        """Activation checkpointing, then FSDP2 sharding when the strategy provides a device mesh."""
        if self._parallel_applied:
            return
        self._parallel_applied = True
        train = self.pipeline.train
        if train.activation_checkpointing:
            self.checkpointed_units = apply_activation_checkpointing(self.model, train.activation_checkpointing)
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None:
            self.sharded_units = apply_fsdp(self.model, train, mesh.device_type)  # its own (replicate, shard) mesh
        if train.compile:
            self.model.compile()

    def configure_optimizers(self):
        train = self.pipeline.train
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                (no_decay if param.ndim <= 1 else decay).append(param)
        optimizer = build_adamw(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=train.lr, sharded=getattr(self, "_device_mesh", None) is not None)
        total = self._total_steps()
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(train.warmup_steps, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _total_steps(self) -> int:
        """Length of the LR schedule: train.max_steps, else epochs x batches per epoch.

        (Lightning's `estimated_stepping_batches` would build the loaders before a resumed
        run restores their position, so it is not used.)
        """
        if self.pipeline.train.max_steps > 0:
            return self.pipeline.train.max_steps
        data = getattr(self.trainer, "datamodule", None)
        per_epoch = data.batches_per_epoch() if hasattr(data, "batches_per_epoch") else None
        return self.pipeline.train.max_epochs * per_epoch if per_epoch else 10_000

    # ------------------------------------------------------------- training

    def forward(self, batch):
        """The network's named outputs for a Batch (`forward_batch` when the network has one)."""
        run = getattr(self.model, "forward_batch", None)
        return run(batch) if run is not None else self.model(batch)

    def training_step(self, batch, batch_idx):
        fail_point("train-step")
        losses = self.model.loss(self(batch), batch)
        self._step_losses = {name: value.detach() for name, value in losses.items()}  # checked before the update
        size = batch.images.shape[0]
        self.log_dict({f"train/loss_{k}": v.detach().float() for k, v in losses.items()},
                      batch_size=size, on_step=True, on_epoch=False, prog_bar=False)
        self.log("loss", losses["total"].detach().float(), batch_size=size, prog_bar=True, on_step=True)
        return losses["total"]

    def validation_step(self, batch, batch_idx):
        losses = self.model.loss(self(batch), batch)
        self.log_dict({f"val/loss_{k}": v.float() for k, v in losses.items()}, batch_size=batch.images.shape[0],
                      on_step=False, on_epoch=True, sync_dist=True, prog_bar=False)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip gradients (also under FSDP2, where Lightning's clipping is not offered), then check
        this step's loss terms and gradient norm before the optimizer applies anything."""
        train = self.pipeline.train
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip if train.grad_clip > 0 else math.inf)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.log("train/grad_norm", norm.float(), on_step=True, on_epoch=False)
        values = dict(getattr(self, "_step_losses", {}))
        if train.precision != "16-mixed":  # fp16's grad scaler skips non-finite gradients on purpose
            values["gradient norm"] = norm.detach()
        self._stop_if_not_finite(values)

    def _stop_if_not_finite(self, values: dict[str, torch.Tensor]) -> None:
        """One flag per step, reduced over ranks (every rank stops together, none hangs in a collective):
        the only host synchronisation the guard adds."""
        flags = torch.stack([~torch.isfinite(v).all() for v in values.values()]).float()
        if self.trainer.world_size > 1:
            flags = self.trainer.strategy.reduce(flags, reduce_op="max")
        flags = flags.cpu()
        if not flags.any():
            return
        names = list(values)
        local = [n for n in names if n != "gradient norm" and not torch.isfinite(values[n]).all()]
        if local:
            shown = "loss term " + ", ".join(f"{n}={values[n].float().flatten()[0].item()}" for n in local)
        elif "gradient norm" in values and not torch.isfinite(values["gradient norm"]).all():
            shown = f"gradient norm={values['gradient norm'].item()}"
        else:
            shown = "a loss term on another rank"
        kept = self.last_good_checkpoint or "none was written yet"
        raise TrainingDiverged(
            f"training diverged at step {self.global_step}: {shown} is not finite. "
            f"Last good checkpoint: {kept}. Lower train.lr, raise train.warmup_steps or set "
            f"train.grad_clip, then resume with train.resume=<that checkpoint>.")

    # ---------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Carry the resolved pipeline (deploy rebuilds the model from it) and the RNG states."""
        checkpoint["pipeline_yaml"], checkpoint["pipeline_hash"] = self.pipeline_text()
        checkpoint["rng_torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            checkpoint["rng_cuda"] = torch.cuda.get_rng_state_all()

    def pipeline_text(self) -> tuple[str, str]:
        """The resolved pipeline's YAML and hash, serialised once per pipeline object: OmegaConf's structured
        conversion took ~0.2 s for each, ~0.4 s of every checkpoint's pause in the training loop (`stack bench
        checkpoint`, the loop rows), twice what the asynchronous save itself stalls."""
        from stack.config import pipeline_to_yaml, yaml_hash

        if self._pipeline_text is None or self._pipeline_text[0] is not self.pipeline:
            text = pipeline_to_yaml(self.pipeline)
            self._pipeline_text = (self.pipeline, text, yaml_hash(text))
        return self._pipeline_text[1], self._pipeline_text[2]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng_torch" in checkpoint:
            torch.set_rng_state(checkpoint["rng_torch"])
        if "rng_cuda" in checkpoint and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["rng_cuda"])

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch.to(device, non_blocking=True) if hasattr(batch, "to") else super().transfer_batch_to_device(
            batch, device, dataloader_idx)


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier: linear warm-up to 1, then cosine decay to 5% at `total_steps`."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor
