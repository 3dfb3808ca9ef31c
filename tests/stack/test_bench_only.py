"""Bench-only baselines ship nothing to users, and `stack bench` still finds them in a source checkout."""

import importlib.util
from pathlib import Path

from stack import bench_only

ROOT = Path(__file__).resolve().parents[2]


def _setup_module():
    spec = importlib.util.spec_from_file_location("stack_setup_for_test", ROOT / "setup.py")
    source = (ROOT / "setup.py").read_text().split("\nsetup(\n")[0]  # the mapping, without running setup()
    namespace: dict = {"__file__": str(ROOT / "setup.py"), "__name__": spec.name}
    exec(compile(source, str(ROOT / "setup.py"), "exec"), namespace)
    return namespace


def test_no_installed_package_holds_bench_only_code():
    setup = _setup_module()
    folders = set(setup["PACKAGE_ROOTS"].values())
    assert "benchmarks" not in folders
    packages = setup["all_packages"]()
    assert not [name for name in packages if "benchmark" in name or "reference" in name]
    stage_files = [p for folder in folders for p in (ROOT / folder).rglob("*.py")]
    assert not [p for p in stage_files if p.name in ("raycast_reference.py", "render_side_by_side.py")]


def test_a_source_checkout_loads_the_baselines_under_a_private_name():
    reference = bench_only.load("raycast_reference")
    assert reference.__name__ == "stack_benchmarks.raycast_reference"
    assert Path(reference.__file__).parent == ROOT / "benchmarks"
    assert callable(reference.render_frame)


def test_without_the_folder_the_rows_are_skipped_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_only, "FOLDER", tmp_path / "benchmarks")
    assert bench_only.load("raycast_reference") is None
    assert "benchmarks/" in bench_only.MISSING
