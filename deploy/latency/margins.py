"""Each predicted target's gate margin, from the errors the latency model has shown on published references.

A prediction is trusted no further than the model has been seen to err on networks it was not fitted to,
on that device. The margin multiplies the predicted latency: 1 / (1 + worst optimistic error), where an
optimistic error is a negative one (predicted faster than published). Rules, per target:

- the fitted device (`orin`, AGX Orin): its leave-one-out errors and its leave-one-family-out errors
  (`stack.deploy.latency.efficiency_fit`): a new network is a new family to the model, so the family
  error counts as much as the per-reference one;
- a device with published references of its own (`orin-nx`, `orin-nano-super`): its own references'
  worst error (AGX Orin efficiencies on its peaks, the harness overhead refitted leave-one-out on the
  device) compounded with AGX Orin's worst leave-one-family-out error: its own references are one family
  (YOLO11) and cannot show a family error, and a new network on another device can be off by both:
  1 / ((1 + worst own) x (1 + worst family));
- any other target (`orin-nano`'s original clocks, `x86-gpu`'s L4, a new target): **unvalidated**, with
  `CONSERVATIVE_MARGIN`: the worst family error seen on AGX Orin compounded with the worst error of the
  AGX Orin fit applied unchanged to another device (no refit at all, the way an unvalidated device is
  predicted): 1 / ((1 + worst family) x (1 + worst transfer)).

The error tables are what `stack bench latency` computes (`efficiency_fit.table`); the slow test in
tests/deploy/test_latency.py recomputes them from the published references.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIT_DEVICE = "orin"

LOO_ERRORS = {
    "ResNet-50 v1.5 224x224 int8": 0.194,
    "CUDA-BEVFusion camera backbone (R50 + LSS-FPN + depth net) 6x3x256x704 int8": -0.103,
    "BERT-Large + SQuAD span head, 384 tokens int8": 0.71,
    "BEVDet-TensorRT BEV pool (BEVPoolv2) 356761 points x 80 channels fp32": 0.143,
    "YOLO11n 640x640 fp16": 0.041, "YOLO11s 640x640 fp16": -0.018, "YOLO11m 640x640 fp16": -0.041,
    "YOLO11l 640x640 fp16": -0.014, "YOLO11x 640x640 fp16": 0.07,
    "YOLO11n 640x640 int8": -0.042, "YOLO11s 640x640 int8": 0.028, "YOLO11m 640x640 int8": 0.024,
    "YOLO11l 640x640 int8": -0.067, "YOLO11x 640x640 int8": 0.132,
}
"""Leave-one-out relative error per AGX Orin reference (fitted on the other 13, then predicted; positive =
pessimistic). BERT-Large's is its prior's: no other reference pins matmul, so without it matmul is 0.3 of peak
against the 0.57 it fits (+71%, over-predicted: a matmul-heavy family the model never saw errs on the slow side).
BEVDet's BEV pool likewise for gather: the prior's 1.0 x DRAM bandwidth against the 1.17 it fits (+14.3%)."""
LOFO_ERRORS = {
    "BERT encoder": {"BERT-Large + SQuAD span head, 384 tokens int8": 0.71},
    "BEV camera backbone": {"CUDA-BEVFusion camera backbone (R50 + LSS-FPN + depth net) 6x3x256x704 int8": -0.103},
    "BEV pooling": {"BEVDet-TensorRT BEV pool (BEVPoolv2) 356761 points x 80 channels fp32": 0.143},
    "PointPillars lidar detector": {"CUDA-PointPillars (OpenPCDet KITTI) 40000 pillars x 32 points fp16": -0.209},
    "ResNet classifier": {"ResNet-50 v1.5 224x224 int8": 0.194},
    "YOLO11 detector": {
        "YOLO11n 640x640 fp16": 0.021, "YOLO11s 640x640 fp16": -0.07, "YOLO11m 640x640 fp16": -0.117,
        "YOLO11l 640x640 fp16": -0.101, "YOLO11x 640x640 fp16": -0.077,
        "YOLO11n 640x640 int8": 0.006, "YOLO11s 640x640 int8": 0.078, "YOLO11m 640x640 int8": 0.084,
        "YOLO11l 640x640 int8": 0.006, "YOLO11x 640x640 int8": 0.179},
}
"""{family: {reference: error}} with the whole family left out of the fit (`leave_one_family_out`; a held-out
family, `Reference.fitted` False, is predicted by the full fit, which never saw it)."""
DEVICE_ERRORS = {
    "orin-nano-super": {
        "YOLO11n 640x640 fp16": -0.106, "YOLO11s 640x640 fp16": -0.076, "YOLO11m 640x640 fp16": -0.004,
        "YOLO11l 640x640 fp16": -0.029, "YOLO11x 640x640 fp16": -0.019,
        "YOLO11n 640x640 int8": 0.012, "YOLO11s 640x640 int8": 0.086, "YOLO11m 640x640 int8": 0.126,
        "YOLO11l 640x640 int8": 0.046, "YOLO11x 640x640 int8": 0.151},
    "orin-nx": {
        "YOLO11n 640x640 fp16": -0.04, "YOLO11s 640x640 fp16": -0.048, "YOLO11m 640x640 fp16": 0.044,
        "YOLO11l 640x640 fp16": -0.004, "YOLO11x 640x640 fp16": -0.017,
        "YOLO11n 640x640 int8": -0.088, "YOLO11s 640x640 int8": 0.072, "YOLO11m 640x640 int8": 0.14,
        "YOLO11l 640x640 int8": 0.045, "YOLO11x 640x640 int8": 0.165},
}
"""{target: {reference: error}} of the AGX Orin fit on other devices' references (harness refitted, LOO)."""
RAW_TRANSFER = {"orin-nano-super": -0.26, "orin-nx": -0.291}
"""{target: worst error of the AGX Orin fit applied to the device unchanged}: how an unvalidated device is
predicted, measured where it can be."""


@dataclass(frozen=True)
class Margin:
    """A target's gate margin and where it comes from, for its report and gate.json."""

    value: float
    status: str
    """`validated` (the target has published references of its own) or `unvalidated`."""
    references: int
    """Published references on the target's own device (0 when unvalidated)."""
    worst_error: float
    """The worst optimistic error the margin covers (its negative relative error)."""
    basis: str

    def to_dict(self) -> dict:
        return {"value": self.value, "status": self.status, "references": self.references,
                "worst_error": self.worst_error, "basis": self.basis}


def gate_margin(errors: dict) -> float:
    """Factor on a prediction that covers the worst optimistic error: 1 / (1 + most negative error), 1 when
    no reference was under-predicted."""
    worst = min(list(errors.values()) + [0.0])
    return round(1.0 / (1.0 + worst), 2)


def margins_from(loo: dict, lofo: dict, devices: dict, raw_transfer: dict) -> dict:
    """{target: Margin} for every target with references, and `"*"`: the unvalidated targets' margin."""
    family = _flat(lofo)
    out = {FIT_DEVICE: _validated(FIT_DEVICE, {**_tag(loo, "LOO"), **_tag(family, "LOFO")},
                                  "leave-one-out and leave-one-family-out errors")}
    worst_family = min(list(family.values()) + [0.0])
    for target, errors in devices.items():
        out[target] = _compounded(target, errors, worst_family)
    out["*"] = _conservative(worst_family, min(list(raw_transfer.values()) + [0.0]))
    return out


def _validated(target: str, errors: dict, how: str) -> Margin:
    worst = min(list(errors.values()) + [0.0])
    own = sum(1 for key in errors if key.startswith(("LOO", "own")))
    which = min(errors, key=errors.get)
    return Margin(gate_margin(errors), "validated", own, worst,
                  f"1/(1 + worst optimistic error) over {how}: {worst:+.1%} ({which})")


def _compounded(target: str, errors: dict, worst_family: float) -> Margin:
    worst_own = min(list(errors.values()) + [0.0])
    which = min(errors, key=errors.get)
    value = round(1.0 / ((1.0 + worst_family) * (1.0 + worst_own)), 2)
    return Margin(value, "validated", len(errors), round(1.0 / value - 1.0, 3),
                  f"its own references' worst error {worst_own:+.1%} ({which}; AGX Orin efficiencies on its peaks, "
                  f"harness refitted leave-one-out) compounded with AGX Orin's worst leave-one-family-out error "
                  f"{worst_family:+.1%}: 1/((1 {worst_own:+.3f}) x (1 {worst_family:+.3f}))")


def _conservative(worst_family: float, worst_transfer: float) -> Margin:
    value = round(1.0 / ((1.0 + worst_family) * (1.0 + worst_transfer)), 2)
    return Margin(value, "unvalidated", 0, round(1.0 / value - 1.0, 3),
                  f"no published reference on this device: the worst family error on AGX Orin ({worst_family:+.1%}) "
                  f"compounded with the worst error of the AGX Orin fit applied unchanged to another device "
                  f"({worst_transfer:+.1%}): 1/((1 {worst_family:+.3f}) x (1 {worst_transfer:+.3f}))")


def _flat(nested: dict) -> dict:
    return {key: error for errors in nested.values() for key, error in errors.items()}


def _tag(errors: dict, tag: str) -> dict:
    return {f"{tag}: {key}": error for key, error in errors.items()}


MARGINS = margins_from(LOO_ERRORS, LOFO_ERRORS, DEVICE_ERRORS, RAW_TRANSFER)
CONSERVATIVE_MARGIN = MARGINS["*"].value
"""The margin of a target with no published reference of its own (`_conservative`)."""


def target_margin(name: str) -> Margin:
    """The gate margin of target `name`: its own (validated) or the conservative one (unvalidated)."""
    return MARGINS.get(name, MARGINS["*"]) if name != "*" else MARGINS["*"]


def validation_note(name: str) -> str:
    """One line on what the prediction for target `name` has been checked against and the margin applied."""
    margin = target_margin(name)
    if margin.status == "unvalidated":
        return (f"UNVALIDATED: target {name!r} has no published reference of its own; its prediction applies the "
                f"AGX Orin efficiencies to its datasheet peaks, unchecked on the device; conservative margin "
                f"x{margin.value:g} ({margin.basis})")
    return f"validated on {margin.references} published references of {name}; margin x{margin.value:g} ({margin.basis})"


def loo_summary() -> str:
    """One line on the stated error: leave-one-out and leave-one-family-out spreads on AGX Orin."""
    loo, family = list(LOO_ERRORS.values()), list(_flat(LOFO_ERRORS).values()) or [0.0]
    return (f"leave-one-out error on {len(loo)} published AGX Orin references ({len(LOFO_ERRORS) or 3} network "
            f"families, INT8 and FP16) from {min(loo):+.0%} to {max(loo):+.0%}, RMS "
            f"{np.sqrt(np.mean(np.square(loo))):.0%}; leave-one-family-out {min(family):+.0%} to {max(family):+.0%}")


CLASS_PINNING = {
    "conv": ("ResNet-50 (MLPerf), CUDA-BEVFusion camera backbone, YOLO11 n-x INT8 and FP16",
             "leave-one-out -10% to +19%"),
    "dwconv": ("no published Orin timing of a grouped-conv network (RegNet, ResNeXt); depthwise ones (MobileNet, "
               "SSD-MobileNet) are too fast per layer to inform it", "unpinned: keeps its prior, carried by the margin"),
    "matmul": ("BERT-Large (MLPerf) only", "leave-one-out +71%"),
    "memory": ("every reference", "inside the leave-one-out errors above"),
    "gather": ("BEVDet-TensorRT BEV pool only", "leave-one-out +14%"),
    "gather_dram": ("BERT-Large's embeddings only", "prior"),
}
"""Operator class (`roofline.KINDS`) -> (the published references that pin its efficiency, how well): what a
predicted FPS verdict rests on, per class (`class_shares`)."""
UNPINNED_CLASSES = {"dwconv": 4.0}
"""Classes no reference pins, with the factor their efficiency may be below its prior: a network's prediction is
re-priced with that class this much slower (`unpinned_factor`), and the gate's margin carries the ratio. Grouped
convs: the prior 0.05 of the dense peak is a guess; a quarter of it (0.0125) is the slowest the CUDA-core kernels of
8-channel groups plausibly run (all their MACs on CUDA cores at a quarter of those cores' share of the peak)."""


def class_shares(workload, efficiency) -> list[dict]:
    """Per operator class of one network's prediction: its predicted ms and share, and what pins the class."""
    shares = workload.share_by_kind(efficiency)
    total = sum(shares.values()) or 1.0
    return [{"class": kind, "ms": ms, "share": ms / total, "pinned_by": CLASS_PINNING.get(kind, ("?", "?"))[0],
             "error": CLASS_PINNING.get(kind, ("?", "?"))[1]} for kind, ms in sorted(shares.items(), key=lambda i: -i[1])]


def unpinned_factor(workload, efficiency) -> float:
    """How much slower the network is predicted with every unpinned class at its slowest plausible efficiency
    (UNPINNED_CLASSES): 1.0 for a network without such layers."""
    from dataclasses import replace

    slow = replace(efficiency, **{kind: getattr(efficiency, kind) / factor for kind, factor in UNPINNED_CLASSES.items()})
    base = workload.total_ms(efficiency)
    return workload.total_ms(slow) / base if base > 0 else 1.0


def with_unpinned(margin: Margin, factor: float) -> Margin:
    """The target's margin times the network's unpinned-class factor, its basis saying so."""
    if factor <= 1.0 + 1e-9:
        return margin
    from dataclasses import replace

    return replace(margin, value=round(margin.value * factor, 4),
                   basis=f"{margin.basis}; x{factor:.3f} for operator classes no published reference pins "
                         f"({', '.join(UNPINNED_CLASSES)} at 1/{max(UNPINNED_CLASSES.values()):g} of its prior)")
