"""Imports run one way (README, "Where each stage lives"): a stage imports only the stages below it.

    stack (schema, rig, kinematics, metrics, ops, checkpoint format)
      <- sim (world, expert, scenarios, vehicle, episode loop, closed-loop evaluation)
      <- data (shards, loaders; renders through sim)      models (plain nn.Modules)
      <- train (models, data)      deploy (models, data, sim; never the trainer)
      <- stack.commands (the CLI: composes the stages)

Checked on the source (every `import` statement, at any depth), so a lazy import inside a function that
breaks the direction is caught too. A network drives the simulator through `stack.sim.policies.Policy`,
whose implementations live with the runtime they use (`stack.deploy.network_policies`), never the other way round.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"sim": "stack.sim", "data": "stack.data", "models": "stack.models", "train": "stack.train",
          "deploy": "stack.deploy"}
ALLOWED = {
    "sim": set(),
    "data": {"stack.sim"},
    "models": set(),
    "train": {"stack.models", "stack.data", "stack.sim"},
    "deploy": {"stack.models", "stack.data", "stack.sim"},
}
BENCH_EXCEPTIONS = {("data/bench.py", "stack.models")}
"""`stack bench data` times a training step of the network on the loader's batches beside the loader itself."""


def imported_names(path: Path) -> set[str]:
    """Every absolute module name an `import` statement of `path` names, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def imported_stages(path: Path) -> set[str]:
    return {stage for name in imported_names(path) for stage in STAGES.values()
            if name == stage or name.startswith(stage + ".")}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_a_stage_imports_only_the_stages_below_it(folder):
    wrong = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for stage in imported_stages(path) - ALLOWED[folder] - {STAGES[folder]}:
            if (relative, stage) not in BENCH_EXCEPTIONS:
                wrong.append(f"{relative} imports {stage}")
    assert not wrong, f"{folder}/ may import only {sorted(ALLOWED[folder]) or 'no other stage'}: " + "; ".join(wrong)


def test_the_ground_floor_imports_stages_only_inside_functions():
    """`stack` (outside the CLI's command modules) is what every stage builds on; a stage it needs for one
    helper is imported where it is used, so `import stack.<module>` never drags a stage in."""
    wrong = []
    for path in sorted((ROOT / "stack").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("stack/commands/"):
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = ast.unparse(node)
                if any(f" {stage}" in module or f" {stage}." in module for stage in STAGES.values()):
                    wrong.append(f"{relative}: {module}")
    assert not wrong, "; ".join(wrong)


def importers(folders, wrong) -> list[str]:
    return [f"{path.relative_to(ROOT).as_posix()} imports {name}" for folder in folders
            for path in sorted((ROOT / folder).rglob("*.py")) for name in sorted(imported_names(path)) if wrong(name)]


def test_only_the_trainer_imports_lightning():
    """Lightning is training's framework: the base layer (checkpoint formats included: `stack.checkpoint`), the
    simulator, data, models and deploy read and write what training made without it (its side of checkpoints is
    `stack.train.checkpoints`)."""
    wrong = importers(("stack", "sim", "data", "models", "deploy"),
                      lambda name: name.split(".")[0] in ("lightning", "pytorch_lightning"))
    assert not wrong, "only train/ may import Lightning: " + "; ".join(wrong)


def test_no_stage_imports_the_cli():
    """The CLI (`stack.cli`, `stack.commands`) composes the stages; a stage that needs what a command checks takes
    it as an argument or owns the check."""
    wrong = importers(sorted(ALLOWED), lambda name: name == "stack.cli" or name.startswith(("stack.cli.",
                                                                                           "stack.commands")))
    assert not wrong, "; ".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from stack.deploy.runner import DeployedNetwork\n    import lightning.pytorch\n")
    assert imported_stages(bad) == {"stack.deploy"}
    assert {"lightning.pytorch", "stack.deploy.runner.DeployedNetwork"} <= imported_names(bad)
