"""How the model is spread over ranks: DDP, FSDP2 (`fully_shard`) and activation checkpointing.

Both the FSDP2 sharding policy (`train.fsdp_units`) and activation checkpointing
(`train.activation_checkpointing`) name parts of the model with module-name
patterns, one glob per `.`-separated level: `backbone` is the backbone,
`backbone.*` each of its stages, `backbone.*.*` each block inside a stage.

FSDP2 runs through Lightning's `ModelParallelStrategy` (Lightning's `strategy="fsdp"`
is FSDP1 and refuses the CPU); the same code uses gloo on CPU ranks and NCCL on
GPUs. FSDP2 paper: https://arxiv.org/abs/2304.11277 (FSDP), API: torch.distributed.fsdp.fully_shard;
the choices below follow torchtitan's `apply_fsdp` (its defaults: parameters bf16, reductions fp32).

Mixed precision under `bf16-mixed` (`fsdp_policies`): FSDP2's `MixedPrecisionPolicy`
all-gathers the parameters in bf16 (half the bytes of an fp32 gather) and reduce-scatters
the gradients in fp32, as torchtitan does by default; the optimizer keeps fp32 shards.
Norm layers (and the children a module runs in fp32, its `keep_fp32`) are sharded as their
own units with no cast, so their weights, the BatchNorm running statistics (buffers, never
cast by FSDP2) and their gradients stay fp32 (pytorch/pytorch#75478). Lightning's `ModelParallelStrategy` pairs `bf16-mixed` with its
autocast plugin, which stays on: the input images arrive as fp32 and the losses ask for
fp32, and autocast casts only fp32 tensors, so the weights FSDP2 already gathered in bf16
are not cast a second time (a `bf16-true` plugin would instead make the master weights bf16).
`16-mixed` keeps fp32 gathers (its gradient scaler expects fp32 gradients).

Hybrid sharding (`train.fsdp_replicate`): the ranks form a (replicate, shard) device mesh
(`init_device_mesh`); parameters are sharded across the `shard` ranks of a node and
replicated across nodes, so all-gathers stay on the fast links inside a node and only
the gradient all-reduce crosses nodes. `train.fsdp_cpu_offload` keeps parameter shards,
gradients and optimizer state in host memory (`CPUOffloadPolicy`; the optimizer step runs
on the CPU); on CPU ranks they are there already, so the key is refused there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stack.errors import ConfigError
from stack.pipeline import TrainConfig
from stack.train.callbacks import RECOMPUTE

NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


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
    The recomputation runs inside `RECOMPUTE.contexts`, where StepStats counts its FLOPs (HFU).
    """
    chosen = _outermost(match_modules(model, patterns, "train.activation_checkpointing"))
    for _, module in chosen:
        forward = module.forward
        module.forward = functools.partial(checkpoint, forward, use_reentrant=False, context_fn=RECOMPUTE.contexts)
    return [name for name, _ in chosen]


def _outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [name for name, _ in named]
    return [(n, m) for n, m in named if not any(n.startswith(other + ".") for other in names)]


@dataclass
class FsdpPolicies:
    """What `fully_shard` is given: the unit policy, the norm layers' policy, and the offload policy."""

    units: object
    norms: object
    offload: object


def fsdp_policies(train: TrainConfig) -> FsdpPolicies:
    """bf16 gathers + fp32 reductions under bf16-mixed (norms never cast); CPU offload when asked."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    no_cast = MixedPrecisionPolicy()
    units = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
             if train.precision == "bf16-mixed" else no_cast)
    offload = CPUOffloadPolicy(pin_memory=True) if train.fsdp_cpu_offload else OffloadPolicy()
    return FsdpPolicies(units=units, norms=no_cast, offload=offload)


def replicas(train: TrainConfig) -> int:
    """How many replicas HSDP keeps: `train.fsdp_replicate`, `auto` meaning one per node."""
    return train.num_nodes if train.fsdp_replicate == "auto" else int(train.fsdp_replicate)


def fsdp_mesh(train: TrainConfig, device_type: str):
    """The (replicate, shard) device mesh of `train`, or its 1-D shard mesh when there is one replica."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate, world = replicas(train), train.devices * train.num_nodes  # TrainConfig checks that replicate | world
    mesh = init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    return mesh["shard"] if replicate == 1 else mesh


def fp32_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose weights stay fp32 under mixed precision: norm layers, and the children a module
    names in its `keep_fp32` (those it runs with autocast off, e.g. the planner's waypoint layer)."""
    found = [m for m in model.modules() if isinstance(m, NORMS)]
    for module in model.modules():
        found += [getattr(module, name) for name in getattr(module, "keep_fp32", ())]
    return [m for m in dict.fromkeys(found) if any(p.requires_grad for p in m.parameters())]


def apply_fsdp(model: nn.Module, train: TrainConfig, device_type: str) -> list[str]:
    """`fully_shard` the norm layers, each `train.fsdp_units` match (innermost first), then the whole model.

    Units are all-gathered one at a time in forward and backward, so peak memory holds
    one unit's full parameters plus everyone's shards.
    """
    from torch.distributed.fsdp import fully_shard

    mesh, policies = fsdp_mesh(train, device_type), fsdp_policies(train)
    named = match_modules(model, train.fsdp_units, "train.fsdp_units")
    uncast = fp32_modules(model) if policies.units != policies.norms else []
    for module in uncast:
        fully_shard(module, mesh=mesh, mp_policy=policies.norms, offload_policy=policies.offload)
    for _, module in sorted(named, key=lambda item: -item[0].count(".")):
        if any(p.requires_grad for p in module.parameters()) and not any(module is m for m in uncast):
            fully_shard(module, mesh=mesh, mp_policy=policies.units, offload_policy=policies.offload)
    fully_shard(model, mesh=mesh, mp_policy=policies.units, offload_policy=policies.offload)
    return [name for name, _ in named]


def build_strategy(train: TrainConfig):
    """The Lightning strategy for `train.strategy` (an object or a Lightning strategy name)."""
    if train.fsdp_cpu_offload and (train.strategy != "fsdp" or accelerator_name(train) == "cpu"):
        raise ConfigError("train.fsdp_cpu_offload=true needs train.strategy=fsdp on GPUs: CPU offload moves FSDP2's "
                          "parameter shards, gradients and optimizer state from GPU memory to host memory, and on "
                          f"CPU ranks they are in host memory already (nothing would be saved; this run: strategy "
                          f"{train.strategy}, accelerator {accelerator_name(train)}). Set train.fsdp_cpu_offload=false, "
                          "or train.strategy=fsdp with train.accelerator=gpu")
    if train.strategy == "fsdp":
        # Data parallel only: every rank is one shard of the data-parallel mesh.
        strategy = fsdp_strategy_class(train.fsdp_cpu_offload)
        return strategy(data_parallel_size=train.devices * train.num_nodes, tensor_parallel_size=1,
                        save_distributed_checkpoint=True)
    if train.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True)
    return "auto"


def fsdp_strategy_class(cpu_offload: bool):
    """Lightning's `ModelParallelStrategy`, or under CPU offload one that leaves the parameters in host memory.

    Lightning calls `configure_model` (where `fully_shard` runs, on the CPU-built model) and then
    moves the whole model to the GPU (`model_to_device`), which would move the offloaded shards
    back onto the GPU; FSDP2 moves them itself around each unit's compute, and the buffers
    (BatchNorm statistics, which FSDP2 does not manage) are the user's to place on the device.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not cpu_offload:
        return ModelParallelStrategy

    class OffloadingModelParallelStrategy(ModelParallelStrategy):
        def model_to_device(self) -> None:
            for module in self.model.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(self.root_device)

    return OffloadingModelParallelStrategy


def accelerator_name(train: TrainConfig) -> str:
    """`cpu` or `gpu`, resolving `auto` by whether CUDA is usable."""
    if train.accelerator != "auto":
        return train.accelerator
    return "gpu" if torch.cuda.is_available() else "cpu"
