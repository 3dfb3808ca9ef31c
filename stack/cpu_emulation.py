"""Run this machine as an older CPU would: the kernel limits of numpy, PyTorch, oneDNN, MKL and OpenBLAS.

Users need it as much as the tests (`tests/conftest.py --emulate-cpu`): `eval "$(python -m stack.cpu_emulation env
avx2)"` before a command makes it compute as an AVX2-only CI machine does, and `make test-portable` asks
`python -m stack.cpu_emulation above LEVEL` whether emulating a level changes anything here.
"""

from __future__ import annotations

EMULATED_CPUS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell"},
    "x86-64-v2": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                  "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OPENBLAS_CORETYPE": "Nehalem"},
}
"""The CPUs a run can pretend to be, and the settings that make PyTorch (ATen's vectorised kernels), oneDNN
(convolutions, bf16/fp32 matmuls), MKL and OpenBLAS pick the kernels they pick on such a CPU. `avx2`: an AVX2-only
AMD EPYC, as some CI machines are (no AVX-512, no AVX512-BF16, no VNNI); `x86-64-v2`: SSE4.2, numpy's baseline.
numpy's own SIMD dispatch is limited through NPY_DISABLE_CPU_FEATURES (`numpy_features_to_disable`)."""


def numpy_features_to_disable(level: str) -> list[str]:
    """The SIMD targets numpy dispatches to on this machine that a CPU of `level` lacks.

    Taken from numpy's own dispatch list, because the names change between versions (numpy 2.4 dispatches
    X86_V3, X86_V4, AVX512_ICL, AVX512_SPR; earlier ones AVX512F, AVX512_SKX, ...) and numpy silently ignores a
    name it does not dispatch to, so a fixed list could limit nothing."""
    if level not in EMULATED_CPUS:
        raise ValueError(f"unknown CPU to emulate {level!r}; expected one of {', '.join(EMULATED_CPUS)}")
    from numpy._core._multiarray_umath import __cpu_dispatch__

    above = ("AVX512", "X86_V4") if level == "avx2" else ("AVX", "FMA", "F16C", "X86_V3", "X86_V4")
    return [name for name in __cpu_dispatch__ if name.startswith(above)]


def emulated_cpu_env(level: str) -> dict[str, str]:
    """Environment variables that make a new process on this machine compute as a CPU of `level` would
    (`EMULATED_CPUS`). They take effect only at start-up: numpy and oneDNN read them once."""
    return {"STACK_EMULATED_CPU": level, "NPY_DISABLE_CPU_FEATURES": " ".join(numpy_features_to_disable(level)),
            **EMULATED_CPUS[level]}


def emulation_problems(level: str) -> list[str]:
    """In a process started with `emulated_cpu_env(level)`: what still uses kernels a CPU of `level` lacks
    (empty when the emulation holds), so a run cannot claim to have tested a CPU it did not emulate."""
    import os

    import torch
    from numpy._core._multiarray_umath import __cpu_features__

    problems = [f"numpy still dispatches to {name} (NPY_DISABLE_CPU_FEATURES="
                f"{os.environ.get('NPY_DISABLE_CPU_FEATURES', '')!r})"
                for name in numpy_features_to_disable(level) if __cpu_features__.get(name)]
    allowed = {"avx2": ("DEFAULT", "AVX2"), "x86-64-v2": ("DEFAULT",)}[level]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in allowed:
        problems.append(f"PyTorch's CPU kernels are {capability} (ATEN_CPU_CAPABILITY="
                        f"{os.environ.get('ATEN_CPU_CAPABILITY')!r}), expected one of {', '.join(allowed)}")
    for name, value in EMULATED_CPUS[level].items():
        if os.environ.get(name) != value:
            problems.append(f"{name}={os.environ.get(name)!r}, expected {value!r}")
    return problems


def cpu_kernels() -> str:
    """One line: the SIMD level numpy and PyTorch dispatch to here, and the limits set on oneDNN, MKL and OpenBLAS."""
    import os

    import torch
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    numpy_targets = [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]
    limits = [f"{name}={os.environ[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                                          "OPENBLAS_CORETYPE") if os.environ.get(name)]
    emulated = os.environ.get("STACK_EMULATED_CPU")
    return (f"numpy dispatches to {' '.join(numpy_targets) or 'its baseline only'}; PyTorch CPU kernels "
            f"{torch.backends.cpu.get_cpu_capability()}" + (f"; {', '.join(limits)}" if limits else "")
            + (f" (emulating an {emulated} CPU)" if emulated else ""))


def above_emulated_cpu(level: str) -> list[str]:
    """What this CPU has that a CPU of `level` lacks (empty: emulating it would change no kernel, so a plain run
    already is such a run; and off x86-64, where these levels do not apply)."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    from numpy._core._multiarray_umath import __cpu_features__

    found = [f"numpy {name}" for name in numpy_features_to_disable(level) if __cpu_features__.get(name)]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in {"avx2": ("DEFAULT", "AVX2"), "x86-64-v2": ("DEFAULT",)}[level]:
        found.append(f"PyTorch {capability}")
    probe = {"avx2": "_is_avx512_supported", "x86-64-v2": "_is_avx2_supported"}[level]
    if getattr(torch.cpu, probe, lambda: False)():
        found.append("oneDNN " + probe[4:-10].upper())
    return found


def _main(argv: list[str]) -> int:
    """python -m stack.cpu_emulation above LEVEL: exit 0 when this CPU has more than LEVEL (so emulating it changes
    something), 1 when not. python -m stack.cpu_emulation env LEVEL: `export` lines of LEVEL's settings, for
    eval "$(python -m stack.cpu_emulation env avx2)" before a command that should compute as such a CPU would."""
    import shlex
    import sys

    if len(argv) != 2 or argv[0] not in ("above", "env") or argv[1] not in EMULATED_CPUS:
        print(f"usage: python -m stack.cpu_emulation {{above,env}} {{{','.join(EMULATED_CPUS)}}}", file=sys.stderr)
        return 2
    if argv[0] == "env":
        print("\n".join(f"export {name}={shlex.quote(value)}" for name, value in emulated_cpu_env(argv[1]).items()))
        return 0
    extra = above_emulated_cpu(argv[1])
    print(f"this CPU has {', '.join(extra)} above {argv[1]}" if extra
          else f"this CPU has nothing above {argv[1]}: a plain run computes as one")
    return 0 if extra else 1


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
