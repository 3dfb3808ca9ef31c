"""The precision a run really trains in: `train.precision`, unless the hardware cannot run it fast.

bf16 autocast pays off only where the matrix units take bf16. On x86 CPUs without
AVX512-BF16 or AMX (AVX2-only AMD EPYC, for one) PyTorch's bf16 matmul takes a slow
fallback path: measured on such a 2-core machine, 0.26 GFLOP/s for bf16 against
157 GFLOP/s for fp32 (2048² matmul), so a run that takes minutes in fp32 would take
hours. Those runs train in `32-true` and say so; CPUs with bf16 instructions (and
non-x86 CPUs, where PyTorch reports nothing) keep what was asked, as do GPUs.
The choice comes from the instruction set, not from a timing, so repeated and resumed
runs on one machine train alike.

"The instruction set" is the one the libraries are allowed to use, not only what the chip has:
`ONEDNN_MAX_CPU_ISA` below AVX512_CORE_BF16 keeps oneDNN, which runs PyTorch's CPU matmuls and
convolutions, off the bf16 instructions (measured on the AVX512-BF16 EPYC: bf16 matmul 440 GFLOP/s,
2.6 with ONEDNN_MAX_CPU_ISA=AVX2, as slow as on an AVX2-only CPU), and `ATEN_CPU_CAPABILITY`
below avx512 tells PyTorch to treat the CPU as one without AVX-512. Either makes the run choose as
such a CPU would, so an AVX2-only CPU can be emulated on a newer one (`stack.cpu_emulation.EMULATED_CPUS`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys

import torch

from stack.pipeline import Pipeline


ONEDNN_ISA_BITS = {
    "SSE41": 0x1, "AVX": 0x3, "AVX2": 0x7, "AVX2_VNNI": 0xF, "AVX2_VNNI_2": 0x1F, "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67, "AVX512_CORE_BF16": 0xE7, "AVX10_1_512": 0x1EF, "AVX512_CORE_FP16": 0x1EF,
    "AVX10_1_512_AMX": 0xFEF, "AVX512_CORE_AMX": 0xFEF, "AVX10_1_512_AMX_FP16": 0x1FEF,
    "AVX512_CORE_AMX_FP16": 0x1FEF,
}
"""oneDNN's `ONEDNN_MAX_CPU_ISA` values and their `dnnl_cpu_isa_t` bits (each ISA's bits include those of the
ISAs it extends). DEFAULT, ALL and names newer than this table do not limit bf16."""
ONEDNN_BF16 = ONEDNN_ISA_BITS["AVX512_CORE_BF16"]
"""The first oneDNN ISA with bf16 dot products (vdpbf16ps); AVX2_VNNI_2 only converts to and from bf16."""


def cpu_bf16_support() -> tuple[bool, str]:
    """(whether bf16 matmuls run natively here, why): the chip must have AVX512-BF16 or AMX, and neither
    ONEDNN_MAX_CPU_ISA nor ATEN_CPU_CAPABILITY may hold PyTorch below them. True off x86 (unknown there:
    the config is trusted)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True, f"{platform.machine()} CPU: PyTorch reports no bf16 support there, the config is trusted"
    probes = {name: getattr(torch.cpu, f"_is_{name}_supported", None) for name in ("avx512_bf16", "amx_tile")}
    probes = {name: probe for name, probe in probes.items() if probe is not None}
    if not probes:
        return True, "this PyTorch cannot tell whether the CPU has bf16 instructions, the config is trusted"
    found = [name for name, probe in probes.items() if probe()]
    if not found:
        return False, ("this CPU has no bf16 matrix instructions (AVX512-BF16/AMX), where bf16 matmuls run hundreds "
                       "of times slower than fp32")
    variable = next((name for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(name)), None)
    onednn = os.environ.get(variable, "").strip().upper() if variable else ""
    if onednn in ONEDNN_ISA_BITS and ONEDNN_ISA_BITS[onednn] & ONEDNN_BF16 != ONEDNN_BF16:
        return False, (f"{variable}={onednn} keeps oneDNN below AVX512_CORE_BF16, off this CPU's bf16 "
                       "matrix instructions (bf16 matmuls then run hundreds of times slower than fp32)")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("DEFAULT", "AVX2"):
        return False, (f"PyTorch's CPU kernels are limited to {capability} (ATEN_CPU_CAPABILITY="
                       f"{os.environ.get('ATEN_CPU_CAPABILITY', '')}): the run computes as a CPU without AVX-512, "
                       "so without AVX512-BF16, would")
    return True, f"this CPU has bf16 matrix instructions ({', '.join(found).replace('_', '-').upper()})"


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU executes bf16 matmuls natively, as PyTorch is allowed to use it (`cpu_bf16_support`)."""
    return cpu_bf16_support()[0]


def effective_precision(requested: str, accelerator: str) -> tuple[str, str | None]:
    """(precision to train in, a one-line notice when it differs from `requested`, else None)."""
    if accelerator == "cpu" and requested == "bf16-mixed":
        fast, why = cpu_bf16_support()
        if not fast:
            return "32-true", (f"train.precision=bf16-mixed: {why}; training in 32-true (the weights and "
                               "checkpoints are fp32 either way).")
    return requested, None


def for_this_hardware(pipeline: Pipeline) -> Pipeline:
    """`pipeline` with `train.precision` replaced by the effective one. A CPU run asked for bf16-mixed says once
    (rank 0) what it trains in and why, whichever way it goes: results differ between CPUs that choose differently."""
    from lightning.pytorch.utilities import rank_zero_only

    from stack.train.parallel import accelerator_name

    accelerator = accelerator_name(pipeline.train)
    precision, notice = effective_precision(pipeline.train.precision, accelerator)
    if notice is None and accelerator == "cpu" and precision == "bf16-mixed":
        notice = f"train.precision=bf16-mixed: {cpu_bf16_support()[1]}; training in bf16-mixed."
    if notice is not None and rank_zero_only.rank == 0:
        print(notice, file=sys.stderr)
    if precision == pipeline.train.precision:
        return pipeline
    return dataclasses.replace(pipeline, train=dataclasses.replace(pipeline.train, precision=precision))
