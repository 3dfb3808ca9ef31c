"""How the model is spread over ranks: DDP, FSDP2 (`fully_shard`) and activation checkpointing.

Both the FSDP2 sharding policy (`train.fsdp_units`) and activation checkpointing
(`train.activation_checkpointing`) name parts of the model with module-name
patterns, one glob per `.`-separated level: `backbone` is the backbone,
`backbone.*` each of its stages, `backbone.*.*` each block inside a stage.

FSDP2 runs through Lightning's `ModelParallelStrategy` (Lightning's `strategy="fsdp"`
is FSDP1 and refuses the CPU); the same code uses gloo on CPU ranks and NCCL on
GPUs. Precision and BatchNorm (pytorch/pytorch#75478): parameters, gradients,
norms and their running-stat buffers all stay fp32 — FSDP2 is given no
`param_dtype`, and bf16/fp16 comes from autocast around the forward — so
BatchNorm statistics are never reduced or stored in low precision.
FSDP2 paper: https://arxiv.org/abs/2304.11277 (FSDP), API: torch.distributed.fsdp.fully_shard.
"""

from __future__ import annotations

import functools
from fnmatch import fnmatchcase
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stack.errors import ConfigError
from stack.pipeline import TrainConfig


def match_modules(model: nn.Module, patterns: Iterable[str], key: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of every submodule whose dotted name matches a pattern, level by level.

    A pattern that matches nothing is a `ConfigError` naming `key` and the names that exist.
    """
    named = [(name, module) for name, module in model.named_modules() if name]
    found: dict[str, nn.Module] = {}
    for pattern in patterns:
        parts = pattern.split(".")
        hits = [(n, m) for n, m in named if _matches(n.split("."), parts)]
        if not hits:
            depth = len(parts)
            nearby = sorted({".".join(n.split(".")[:depth]) for n, _ in named})[:12]
            raise ConfigError(
                f"{key}: pattern {pattern!r} matches no module of the model. Module names at that "
                f"depth include: {', '.join(nearby)}. Use those names, with `*` for any name at a level."
            )
        found.update(hits)
    return sorted(found.items(), key=lambda item: item[0])


def _matches(name_parts: list[str], pattern_parts: list[str]) -> bool:
    return len(name_parts) == len(pattern_parts) and all(
        fnmatchcase(n, p) for n, p in zip(name_parts, pattern_parts))


def apply_activation_checkpointing(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Recompute the matched modules' activations in backward instead of storing them.

    The module's own `forward` is wrapped, so state-dict keys stay unchanged (checkpoints
    and deploy do not see the difference). Nested matches are wrapped once, outermost.
    BatchNorm inside a recomputed module updates its running statistics in the forward and
    again in the recompute (the same batch twice: a slightly faster moving average); the
    gradients are exactly those of the plain module (tests/train/test_parallel.py).
    """
    chosen = _outermost(match_modules(model, patterns, "train.activation_checkpointing"))
    for _, module in chosen:
        forward = module.forward
        module.forward = functools.partial(checkpoint, forward, use_reentrant=False)
    return [name for name, _ in chosen]


def _outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [name for name, _ in named]
    return [(n, m) for n, m in named if not any(n.startswith(other + ".") for other in names)]


def apply_fsdp(model: nn.Module, patterns: Iterable[str], mesh) -> list[str]:
    """`fully_shard` each matched module (innermost first), then the whole model.

    Units are all-gathered one at a time in forward and backward, so peak memory holds
    one unit's full parameters plus everyone's shards.
    """
    from torch.distributed.fsdp import fully_shard

    named = match_modules(model, patterns, "train.fsdp_units")
    for _, module in sorted(named, key=lambda item: -item[0].count(".")):
        if any(p.requires_grad for p in module.parameters()):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return [name for name, _ in named]


def build_strategy(train: TrainConfig):
    """The Lightning strategy for `train.strategy` (an object or a Lightning strategy name)."""
    if train.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # Data parallel only: every rank is one shard of the data-parallel mesh.
        return ModelParallelStrategy(data_parallel_size=train.devices * train.num_nodes, tensor_parallel_size=1,
                                     save_distributed_checkpoint=True)
    if train.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True)
    return "auto"


def accelerator_name(train: TrainConfig) -> str:
    """`cpu` or `gpu`, resolving `auto` by whether CUDA is usable."""
    if train.accelerator != "auto":
        return train.accelerator
    return "gpu" if torch.cuda.is_available() else "cpu"
