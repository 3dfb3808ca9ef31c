"""`export`: ONNX export, INT8 calibration and the accuracy gate's samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from stack.pipeline.checks import Problems, bounded, in_range, positive


EXPORT_BOUNDS = (
    ("batch_size", 256, "frames per engine run (a car's computer runs one frame at a time); e.g. 1"),
    ("calibration_samples", 100_000, "samples (INT8 ranges settle within hundreds); e.g. 64"),
    ("accuracy_samples", 100_000, "samples (each runs fp32 and INT8); e.g. 32"),
    ("sensitivity_samples", 10_000, "samples (each runs once per ranked layer); e.g. 4"),
    ("max_fp32_layers", 10_000, "layers (more than the network has); e.g. 8"),
    ("timing_runs", 100_000, "runs per model (a p99 settles within hundreds); e.g. 100"),
    ("timing_warmup", 10_000, "runs; e.g. 10"),
)
"""Upper bounds of ExportConfig's counts: (field, bound, why)."""


@dataclass
class ExportConfig:
    """How `stack export` writes the ONNX graph and how it is quantized."""

    out_dir: str = "runs/export"
    """Folder for ONNX files and deploy bundles."""
    opset: int = 17
    """ONNX opset; 17 is read by TensorRT 8.6 (JetPack 5) and 10.x (JetPack 6)."""
    batch_size: int = 1
    """Static batch size baked into the graph (engines run one frame at a time)."""
    calibration_samples: int = 64
    """Validation samples used to calibrate INT8 activation ranges."""
    parity_atol: float = 1e-3
    """Largest allowed |ONNX Runtime - PyTorch| per fp32 output (plus parity_rtol x the output's peak)."""
    parity_rtol: float = 1e-3
    """Relative part of the parity tolerance, times the largest |PyTorch output| of that output."""
    accuracy_samples: int = 32
    """Validation samples on which fp32 and INT8 are scored per head (the accuracy gate)."""
    keep_fp32: List[str] = field(default_factory=lambda: ["view_transform", "planning_head"])
    """Substrings of ONNX node names never quantized: the BEV pooling's gathers and matmuls, and the
    planning head (0.02% of the FLOPs; its waypoints are metres, where INT8 weights cost L2)."""
    max_fp32_layers: int = 8
    """Most layers the accuracy gate may keep in fp32 when a head exceeds its budget (0: no fallback)."""
    sensitivity_samples: int = 4
    """Validation samples used to rank layers by quantization sensitivity."""
    timing_runs: int = 100
    """Timed runs per model when latency is measured (median and p99 over them)."""
    timing_warmup: int = 10
    """Untimed runs before timing (allocations, thread pools, caches)."""

    def problems(self) -> Problems:
        found: Problems = []
        in_range(found, "opset", self.opset, 13, 23)
        positive(found, "batch_size", self.batch_size)
        positive(found, "calibration_samples", self.calibration_samples)
        positive(found, "parity_atol", self.parity_atol)
        for name in ("accuracy_samples", "sensitivity_samples", "timing_runs"):
            positive(found, name, getattr(self, name))
        for name in ("parity_rtol", "max_fp32_layers", "timing_warmup"):
            if getattr(self, name) < 0:
                found.append((name, f"got {getattr(self, name)}; must be >= 0"))
        if self.timing_runs < 20:
            found.append(("timing_runs", f"got {self.timing_runs}; a p99 needs at least 20 runs"))
        bounded(found, self, EXPORT_BOUNDS)
        return found
