"""The precision a run really trains in: `train.precision`, unless the hardware cannot run it fast.

bf16 autocast pays off only where the matrix units take bf16. On x86 CPUs without
AVX512-BF16 or AMX (AVX2-only AMD EPYC, for one) PyTorch's bf16 matmul takes a slow
fallback path: measured on such a 2-core machine, 0.26 GFLOP/s for bf16 against
157 GFLOP/s for fp32 (2048² matmul), so a run that takes minutes in fp32 would take
hours. Those runs train in `32-true` and say so; CPUs with bf16 instructions (and
non-x86 CPUs, where PyTorch reports nothing) keep what was asked, as do GPUs.
The choice comes from the instruction set, not from a timing, so repeated and resumed
runs on one machine train alike.
"""

from __future__ import annotations

import dataclasses
import platform
import sys

import torch

from stack.pipeline import Pipeline


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU executes bf16 matmuls natively (AVX512-BF16 or AMX); True off x86 (unknown: trust the config)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    probes = [probe for probe in probes if probe is not None]
    return not probes or any(probe() for probe in probes)


def effective_precision(requested: str, accelerator: str) -> tuple[str, str | None]:
    """(precision to train in, a one-line notice when it differs from `requested`, else None)."""
    if accelerator == "cpu" and requested == "bf16-mixed" and not cpu_has_fast_bf16():
        return "32-true", ("train.precision=bf16-mixed: this CPU has no bf16 matrix instructions "
                           "(AVX512-BF16/AMX), where bf16 matmuls run hundreds of times slower than fp32; "
                           "training in 32-true (the weights and checkpoints are fp32 either way).")
    return requested, None


def for_this_hardware(pipeline: Pipeline) -> Pipeline:
    """`pipeline` with `train.precision` replaced by the effective one (printed once when it changes)."""
    from lightning.pytorch.utilities import rank_zero_only

    from stack.train.parallel import accelerator_name

    precision, notice = effective_precision(pipeline.train.precision, accelerator_name(pipeline.train))
    if notice is None:
        return pipeline
    if rank_zero_only.rank == 0:
        print(notice, file=sys.stderr)
    return dataclasses.replace(pipeline, train=dataclasses.replace(pipeline.train, precision=precision))
