"""The fingerprint of the machine a bench ran on: what decides whether two records may be compared.

Our machines differ between sessions in exactly the ways that move timings several-fold (DESIGN.md,
facts of 2026-11-23): an AVX2-only EPYC, an AVX-512 EPYC with BF16 and VNNI, an Intel with AMX, and a
lent GPU. Two records are compared only when their `hardware` is the same: the CPU model, the ISA
features the kernels dispatch on (`ISA_FEATURES`), the cores this process may use and the GPU. The
`software` versions (python, torch, onnxruntime, numpy) are recorded and shown beside a comparison but
do not block it: a library upgrade is a change whose cost one wants measured, like a commit.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

ISA_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""/proc/cpuinfo flags that change which kernels run (oneDNN, ONNX Runtime, numpy dispatch)."""
PACKAGES = ("torch", "onnxruntime", "numpy")
"""Distributions whose versions a record carries beside python's."""


def fingerprint() -> dict:
    """{"hardware": {...}, "software": {...}} of this machine and environment."""
    return {"hardware": hardware(), "software": software()}


def cpu_model() -> str:
    """The CPU's model name, as reports name the machine a figure was measured on."""
    return _cpuinfo()[0]


def hardware() -> dict:
    model, flags = _cpuinfo()
    return {"cpu": model, "isa": [flag for flag in ISA_FEATURES if flag in flags], "cores": _usable_cores(),
            "gpu": _gpu_name()}


def software() -> dict:
    return {"python": platform.python_version(), **{name: _version(name) for name in PACKAGES}}


def hardware_differences(a: dict, b: dict) -> list[str]:
    """What differs between two `hardware` fingerprints, one phrase per key ([] when they are the same)."""
    found = []
    for key in sorted(set(a) | set(b)):
        first, second = a.get(key), b.get(key)
        if first == second:
            continue
        if key == "isa":
            only_a = [f for f in first or [] if f not in (second or [])]
            only_b = [f for f in second or [] if f not in (first or [])]
            found.append("isa: " + "; ".join(part for part in (
                f"only the first has {' '.join(only_a)}" if only_a else "",
                f"only the second has {' '.join(only_b)}" if only_b else "") if part))
        else:
            found.append(f"{key}: {first!r} vs {second!r}")
    return found


def describe(hardware_fingerprint: dict) -> str:
    """'AMD EPYC (avx2 avx512f ...), 2 cores, no GPU' for headers."""
    isa = " ".join(hardware_fingerprint.get("isa") or []) or "no AVX2"
    gpu = hardware_fingerprint.get("gpu") or "no GPU"
    return f"{hardware_fingerprint.get('cpu')} ({isa}), {hardware_fingerprint.get('cores')} cores, {gpu}"


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; (platform's name, no flags) elsewhere."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or "unknown CPU", flags


def _usable_cores() -> int:
    """Cores this process may run on (a container or taskset can allow fewer than the host has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
