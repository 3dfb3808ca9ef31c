"""Where a training step's time goes, part by part, against this machine's roofline (`stack profile`).

One training step runs under a dispatch mode that times every ATen operator as it executes (on a CPU an
operator runs synchronously, so its wall time is its own; on a GPU each one is synchronised), counts its
FLOPs (torch's formulas, with `stack.train.callbacks.step_flop_counter`'s for convolution backward) and the
bytes it reads and writes (its distinct tensor arguments and results: what an unfused operator moves at
least), and charges them to the network's top-level part running at that moment in forward
(`torch.utils.module_tracker.ModuleTracker`), to the loss, to the backward as a whole, or to the optimizer.

An operator's floor is the longer of its FLOPs over the matmul peak at its dtype and its bytes over the memory
bandwidth, both measured in the same run (`PeakRates`); a part's floor is the sum of its operators'. A part
near its floor needs a cheaper algorithm or fewer bytes (fusion) to go faster; a part far above it needs a
better kernel. Figures: docs/results/training.md ("Where a training step's time goes").
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from stack.train.callbacks import measure_peak_tflops, step_flop_counter

SHAPE_QUERIES = {torch.ops.aten.is_contiguous.default, torch.ops.aten.is_contiguous.memory_format,
                 torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.numel.default,
                 torch.ops.aten.dim.default, torch.ops.aten.storage_offset.default}
"""Metadata queries: no work, not counted."""


@dataclass
class PeakRates:
    """The roofline's two ceilings on this machine, measured: matmul TFLOP/s per dtype, and copy bandwidth."""

    tflops: dict[torch.dtype, float]
    bandwidth_gbs: float

    @classmethod
    def measure(cls, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> "PeakRates":
        return cls({dtype: measure_peak_tflops(device, dtype) for dtype in dtypes}, measure_bandwidth_gbs(device))

    def floor_s(self, flops: float, nbytes: float, dtype: torch.dtype) -> tuple[float, float]:
        """(compute floor, memory floor) of one operator, seconds."""
        peak = self.tflops.get(dtype, self.tflops[torch.float32])
        return flops / (peak * 1e12), nbytes / (self.bandwidth_gbs * 1e9)


def measure_bandwidth_gbs(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Read + write GB/s of the best of `repeats` copies of a buffer far larger than the caches."""
    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # fault the pages in
    best = 0.0
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = max(best, 2 * source.nbytes / (time.perf_counter() - start))
    return best / 1e9


@dataclass
class PartCost:
    """What one part's operators did in one phase: measured seconds, FLOPs, bytes, floors (seconds)."""

    seconds: float = 0.0
    flops: float = 0.0
    nbytes: float = 0.0
    compute_floor: float = 0.0
    memory_floor: float = 0.0
    floor: float = 0.0
    operators: int = 0
    top: dict = field(default_factory=lambda: defaultdict(float))
    """Seconds per operator name, for the part's biggest costs."""


class _OperatorCosts(TorchDispatchMode):
    """Times, counts and charges every operator (see the module docstring)."""

    def __init__(self, rates: PeakRates, tracker: ModuleTracker, model: nn.Module, device: torch.device):
        super().__init__()
        self.rates, self.tracker, self.device = rates, tracker, device
        self.names = _tracker_names(model)
        self.formulas = step_flop_counter().flop_registry
        self.phase = "forward"
        self.costs: dict[tuple[str, str], PartCost] = defaultdict(PartCost)

    def part(self) -> tuple[str, str]:
        """(part, phase) of the operator running now: in forward a top-level child of the network, "loss", or
        "between parts" (the network's own glue between its children); the whole backward as one row (the
        tracker's backward hooks cannot tell a part whose inputs need no gradient, the image encoder, from the
        one after it); "optimizer"."""
        if self.phase == "optimizer":
            return "optimizer", "step"
        if self.tracker.is_bw:
            return "network and loss", "backward"
        children = [self.names[name] for name in self.tracker.parents if name in self.names]
        if children:
            return children[0], "forward"
        return ("loss" if self.phase == "loss" else "between parts"), "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SHAPE_QUERIES:
            return func(*args, **kwargs)
        _sync(self.device)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        packet = func._overloadpacket
        flops = float(self.formulas[packet](*args, **kwargs, out_val=out)) if packet in self.formulas else 0.0
        nbytes, dtype = _bytes_and_dtype((args, kwargs, out))
        compute, memory = self.rates.floor_s(flops, nbytes, dtype)
        cost = self.costs[self.part()]
        cost.seconds += elapsed
        cost.flops += flops
        cost.nbytes += nbytes
        cost.compute_floor += compute
        cost.memory_floor += memory
        cost.floor += max(compute, memory)
        cost.operators += 1
        cost.top[str(packet).split(".")[-1]] += elapsed
        return out


def _tracker_names(model: nn.Module) -> dict[str, str]:
    """ModuleTracker's possible names of each top-level child -> the child's name. The tracker names a module
    "<Root>.<child>" when it first sees it called from its parent's forward, and by its class when it first sees
    it called from elsewhere (a network method that encodes the previous key frame before its forward runs);
    a class two children share names neither."""
    root = type(model).__name__
    names = {f"{root}.{name}": name for name, _ in model.named_children()}
    classes = defaultdict(list)
    for name, child in model.named_children():
        classes[type(child).__name__].append(name)
    names.update({cls: members[0] for cls, members in classes.items() if len(members) == 1})
    return names


def _bytes_and_dtype(tree) -> tuple[float, torch.dtype]:
    """Bytes of the distinct tensors in `tree` (a view counts its own elements, a storage once), and the dtype of
    the largest floating-point one (which peak applies)."""
    seen, total, largest, dtype = set(), 0, -1, torch.float32
    for leaf in tree_flatten(tree)[0]:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
            continue
        size = min(leaf.numel() * leaf.element_size(), leaf.untyped_storage().nbytes())
        key = (leaf.untyped_storage().data_ptr(), leaf.storage_offset(), size)
        if key in seen:
            continue
        seen.add(key)
        total += size
        if leaf.is_floating_point() and size > largest:
            largest, dtype = size, leaf.dtype
    return float(total), dtype


@contextlib.contextmanager
def _phase(mode: _OperatorCosts, name: str):
    previous, mode.phase = mode.phase, name
    try:
        yield
    finally:
        mode.phase = previous


def step_roofline(model: nn.Module, batch, optimizer, rates: PeakRates, autocast, device: torch.device
                  ) -> dict[tuple[str, str], PartCost]:
    """One training step (forward, loss, backward, optimizer) with every operator charged to its part."""
    run = getattr(model, "forward_batch", None) or model
    tracker = ModuleTracker()
    mode = _OperatorCosts(rates, tracker, model, device)
    with tracker, mode:
        with autocast():
            outputs = run(batch)
            with _phase(mode, "loss"):
                loss = model.loss(outputs, batch)["total"]
        loss.backward()
        with _phase(mode, "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return dict(mode.costs)


def roofline_rows(costs: dict[tuple[str, str], PartCost]) -> list[dict]:
    """One row per (part, phase), in the order they ran, and a total row."""
    rows = []
    for (part, phase), cost in costs.items():
        top = sorted(cost.top.items(), key=lambda item: -item[1])[:2]
        rows.append({"part": part, "phase": phase, "ms": 1e3 * cost.seconds, "gflop": cost.flops / 1e9,
                     "mb": cost.nbytes / 2**20, "compute_floor_ms": 1e3 * cost.compute_floor,
                     "memory_floor_ms": 1e3 * cost.memory_floor, "floor_ms": 1e3 * cost.floor,
                     "operators": cost.operators,
                     "top": ", ".join(f"{name} {1e3 * seconds:.0f} ms" for name, seconds in top)})
    total = {key: sum(row[key] for row in rows) for key in
             ("ms", "gflop", "mb", "compute_floor_ms", "memory_floor_ms", "floor_ms", "operators")}
    rows.append({"part": "step", "phase": "all", **total, "top": ""})
    return rows


def roofline_table(rows: list[dict], rates: PeakRates) -> str:
    """The rows as a Markdown table, the ceilings they were measured against named under it."""
    lines = ["| part | phase | operator ms | GFLOP | MiB moved | floor ms (compute / memory) | operator ms / floor | "
             "largest operators |", "|---|---|---:|---:|---:|---|---:|---|"]
    for row in rows:
        ratio = f"{row['ms'] / row['floor_ms']:.1f}x" if row["floor_ms"] > 0 else "-"
        lines.append(f"| {row['part']} | {row['phase']} | {row['ms']:.1f} | {row['gflop']:.2f} | {row['mb']:.0f} | "
                     f"{row['floor_ms']:.1f} ({row['compute_floor_ms']:.1f} / {row['memory_floor_ms']:.1f}) | "
                     f"{ratio} | {row['top']} |")
    peaks = ", ".join(f"{str(dtype).removeprefix('torch.')} {tflops:.3g} TFLOP/s" for dtype, tflops in rates.tflops.items())
    lines.append(f"ceilings measured in this run: matmul {peaks}; copy bandwidth {rates.bandwidth_gbs:.1f} GB/s. "
                 "An operator's floor is the longer of FLOPs / peak and bytes / bandwidth.")
    return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
