"""Bench-only baselines from the repository's `benchmarks/` folder, which is not installed.

What the product replaced (the reference ray caster, the previous CPU kernel of `stack::bev_pool`)
stays useful as a baseline for `stack bench` and as an oracle for tests, but it is not product code:
it lives beside the stage folders in `benchmarks/`, and setup.py installs nothing from there. From a
source checkout (the editable install `make` does) this module imports it under the private name
`stack_benchmarks`, without putting the repository root on `sys.path` (which would expose the stage
folders `data`, `models`, ... as top-level packages). Installed from a wheel, `load` returns None and
the benchmark says which rows it skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "stack_benchmarks"
FOLDER = Path(__file__).resolve().parents[1] / "benchmarks"
"""`benchmarks/` of the source checkout this `stack` was imported from (absent in a wheel install)."""

MISSING = ("bench-only baselines are not installed: they live in the source checkout's benchmarks/ folder; "
           "run `stack bench` from an editable install of the repository (`make install`) to time them")


def available() -> bool:
    return (FOLDER / "__init__.py").is_file()


def load(name: str) -> ModuleType | None:
    """`benchmarks/<name>.py` as a module, or None where this `stack` was not installed from a source checkout."""
    if not available():
        return None
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, FOLDER / "__init__.py",
                                                      submodule_search_locations=[str(FOLDER)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.{name}")
