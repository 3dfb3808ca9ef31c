"""Property test: any override value, for keys of every type, either configures the pipeline or is bad input.

`stack config KEY=VALUE` with generated values (control characters, unicode, very long
strings, numbers in odd formats, YAML specials and tags) must exit 0, or exit 2 with a
message, never a traceback or another exit code. Most cases apply the override to a
copy of the loaded configuration (`stack.config.apply_overrides`, the code every command
runs for its overrides; ~25 ms each), a sample runs the whole CLI in process (`main`, with
file loading and printing; ~0.2 s each), and a handful go through the real `stack` executable.
"""

import contextlib
import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stack.cli import main
from stack.config import apply_overrides, base_config
from stack.errors import StackError

MARKER = f"/tmp/stack-hostile-marker-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}"
"""Where an injected command would leave its trace; one name per test run, the same in each of its `pytest -n`
workers (they must collect the same parametrisations)."""
"""A file the hostile values would create if anything ran them as a command (per test run, so nothing stale)."""

REPO = Path(__file__).resolve().parents[2]
KEYS = [
    "name", "train.max_epochs", "train.lr", "train.compile", "train.resume", "train.out_dir", "train.slurm_time",
    "train.slurm_partition", "train.slurm_extra", "train.slurm_extra.0", "train.rendezvous",
    "data.augment.resize_scale", "data.augment.resize_scale.1", "data.world.class_mix", "data.world.class_mix.car",
    "data.rig.cameras.0.name", "data.rig.cameras.0", "data.root", "model", "model.backbone_checkpoint",
    "targets.orin.description", "targets.orin.min_fps", "targets.orin", "targets", "export.keep_fp32",
]
"""A sample of keys of every type: str, int, float, bool, Optional, lists, dicts, list items, sections."""
SPECIALS = [
    "1e999", "-1e999", "0x10", "0o17", "0b101", "1_000", ".5", "-0", "+0.0", "nan", ".nan", "inf", ".inf", "-.inf",
    "12:00:00", "1:30", "190:20:30", "1:30.5", "2026-01-01", "2026-01-01T10:00:00Z", "~", "null", "Null", "NULL",
    "[", "]", "{a:", "{}", "[]", "[[]]", "{a: {b: [1, {c: d}]}}", "!!python/object:os.system", "!!python/name:os.system",
    "!!binary aGVsbG8=", "!!set {a, b}", "!!str 5", "!!int x", "&a [*a]", "*undefined", "yes", "no", "on", "off",
    "'", '"', "'unterminated", "a: b", "- a", "? a", "%YAML 1.2", "---", "...", "#comment", "|", ">", "@x", "`x`",
    f"$(touch {MARKER})", f"`touch {MARKER}`", "a;b", "a\nb", "a\x00b", "\x1b[31m", "é", "🚗", "\u202e",
    "a" * 5000, "-" * 300, "9" * 400, "--account=x", "../../etc", "/", ".", "[" * 300 + "]" * 300,
    "{a: " * 60 + "1" + "}" * 60,
]
VALUES = st.one_of(st.sampled_from(SPECIALS), st.text(max_size=40), st.text(alphabet=st.characters(max_codepoint=0x7f)),
                   st.integers().map(str), st.floats().map(repr), st.lists(st.sampled_from(SPECIALS), max_size=3).map(
                       lambda items: "[" + ", ".join(items) + "]"))


def config_in_process(override: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["config", override])
    return code, err.getvalue()


def assert_accepted_or_bad_input(code: int, err: str, override: str) -> None:
    assert code in (0, 2), (override, code, err)
    assert "Traceback" not in err, (override, err)
    if code == 2:
        assert err.startswith("stack config: error: ") and len(err.strip()) > len("stack config: error: "), err
        assert "bad value for ''" not in err and "(None)" not in err, err  # a message names its key


BASE = base_config()


def configure(override: str) -> tuple[int, str]:
    """(0, "") when the override gives a valid pipeline, (2, message) when it is refused as bad input."""
    try:
        apply_overrides(copy.deepcopy(BASE), [override])
    except StackError as exc:
        return 2, f"stack config: error: {exc}"
    return 0, ""


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_override_value_is_accepted_or_refused_with_a_message(key, value):
    override = f"{key}={value}"
    assert_accepted_or_bad_input(*configure(override), override)


@pytest.mark.parametrize("index", range(len(SPECIALS)))
def test_every_special_value_on_three_keys(index):
    """Each listed value on three keys (rotating through KEYS, so every key meets ~10 of them)."""
    for key in (KEYS[index % len(KEYS)], KEYS[(index + 8) % len(KEYS)], KEYS[(index + 17) % len(KEYS)]):
        override = f"{key}={SPECIALS[index]}"
        assert_accepted_or_bad_input(*configure(override), override)


@settings(max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_the_cli_in_process_exits_0_or_2(key, value):
    override = f"{key}={value}"
    assert_accepted_or_bad_input(*config_in_process(override), override)


@pytest.mark.parametrize("override", ["train.slurm_time=12:00:00", "train.lr=1e999", "name=a\nb",
                                      f"train.slurm_extra=[$(touch {MARKER})]",
                                      "targets.orin=!!python/object:os.system",
                                      "data.augment.resize_scale=[", "train.max_epochs=0x10", "name=" + "🚗" * 2000])
def test_through_the_real_executable(override):
    stack = Path(sys.executable).with_name("stack")
    result = subprocess.run([str(stack) if stack.exists() else "stack", "config", override], cwd=REPO,
                            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert_accepted_or_bad_input(result.returncode, result.stderr, override)
    assert not Path(MARKER).exists()


SCRIPT_KEYS = ["train.slurm_time", "train.slurm_partition", "train.slurm_extra", "train.slurm_extra.0", "name",
               "train.out_dir", "train.rendezvous", "train.slurm_mem", "train.slurm_cpus_per_task",
               "train.slurm_signal_seconds", "train.slurm_container_image", "train.slurm_container_mounts",
               "train.slurm_container_mounts.0"]
"""Keys whose values reach the sbatch script `stack train --dry-run train.launcher=slurm` writes."""


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(SCRIPT_KEYS), value=VALUES)
def test_generated_values_never_add_a_command_to_the_sbatch_script(key, value, tmp_path_factory):
    import shlex

    out = tmp_path_factory.mktemp("run")
    override = f"{key}={out}/{value}" if key == "train.out_dir" else f"{key}={value}"  # never outside tmp
    argv = ["train", "--dry-run", "train.launcher=slurm", "train.slurm_extra=[--exclusive]", f"train.out_dir={out}",
            override]
    stdout, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout):
        code = main(argv)
    assert code in (0, 2) and "Traceback" not in err.getvalue(), (override, code, err.getvalue())
    if code == 2:
        return
    script = stdout.getvalue()
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0, script
    commands = [line.split()[0] for line in script.splitlines()[1:] if line and not line.startswith("#")]
    assert commands == ["set", "cd", "export", "srun"], script
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            assert len(shlex.split(line[len("#SBATCH "):])) == 1, line  # sbatch's quoting: one option per line
