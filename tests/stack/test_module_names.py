"""One meaning per module name across the installed tree, so that a name in a traceback or an import says
which module it is (issue 23: three `evaluate.py`, two `gate.py` and two `report.py` meant different things).

A name may repeat only where it means the same thing in each place: `__init__`, `bench` (the stage's
`stack bench` rows), and a CLI command module (`stack/commands/X.py`) beside the
stage module that does what `stack X` runs.
"""

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("stack", "sim", "data", "models", "train", "deploy")
SAME_MEANING = {"__init__.py", "bench.py"}
COMMANDS = ROOT / "stack" / "commands"


def test_no_two_modules_share_a_name_for_different_things():
    where = defaultdict(list)
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            where[path.name].append(path)
    clashes = []
    for name, paths in sorted(where.items()):
        if name in SAME_MEANING:
            continue
        stage_modules = [p for p in paths if p.parent != COMMANDS]
        if len(stage_modules) > 1:
            clashes.append(f"{name}: " + ", ".join(str(p.relative_to(ROOT)) for p in stage_modules))
    assert not clashes, "module names used for different things: " + "; ".join(clashes)


def test_no_installed_module_is_a_test_helper():
    """Helpers only the tests use live under tests/ (`tests/helpers.py`), not in what users install."""
    shipped = [p.relative_to(ROOT).as_posix() for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
               if p.stem in ("testing", "conftest")]
    assert not shipped, f"test helpers in the installed packages: {shipped}"
