"""Seeded synthetic samples and records: the comparison is tested on known distributions, never on timings."""

import numpy as np

from stack.benchrecord.figures import Figure
from stack.benchrecord.records import Record

MACHINE = {"hardware": {"cpu": "Test CPU 9000", "isa": ["avx2", "avx512f"], "cores": 2, "gpu": None},
           "software": {"python": "3.11.7", "torch": "2.14.1", "onnxruntime": "1.32.0", "numpy": "2.4.6"}}
ARGUMENTS = {"config": ["configs/pipeline.yaml"], "overrides": [], "environment": {}}


def noisy(level: float, n: int = 7, seed: int = 0, spread: float = 0.05) -> list[float]:
    """n samples around `level` with multiplicative log-normal noise, as repeated timings scatter."""
    return list(level * np.random.default_rng(seed).lognormal(0.0, spread, n))


def make_record(commit: str, samples: dict, *, bench: str = "ops", machine: dict = MACHINE, minute: int = 0,
                unit: str = "s", lower_is_better: bool = True, floor: float | None = None) -> Record:
    """A record of `bench` at `commit` holding one figure per entry of `samples` (name -> samples)."""
    figures = {name: Figure(name, tuple(values), unit, lower_is_better, floor) for name, values in samples.items()}
    return Record(bench=bench, arguments=ARGUMENTS, commit=commit, dirty=False, machine=machine,
                  pipeline={"name": "tiny", "hash": "0123456789abcdef"},
                  recorded_at=f"2026-11-24T10:{minute:02d}:00Z", exit_code=0, figures=figures)


RAN: list = []
"""The benches `quick_bench` stood in for (tests point the registry's entry at it)."""


def quick_bench(pipeline, args) -> int:
    """A bench that measures nothing: one figure of two samples, in no time."""
    from stack.benchrecord import figures_of

    RAN.append(args.name)
    figures_of(args).add("op", [1.0, 1.1], "s")
    return 0
