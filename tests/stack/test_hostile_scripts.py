"""Config values never add a command to a generated script, and target names never leave export.out_dir.

The sbatch script (stack.train.launch) is checked three ways: the schema refuses values
that cannot be written safely (control characters, malformed SLURM keys); `bash -n`
accepts what is written; and running the script with a stand-in `srun` shows that a
hostile but legal path (spaces, quotes, `;`, `$(…)`, backticks) stays one argument and
runs nothing. `#SBATCH` lines are parsed as sbatch parses them (shell-like quoting).
"""

import contextlib
import io
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from stack.cli import main
from stack.config import load_pipeline
from stack.errors import ConfigError
from stack.train.launch import sbatch_script

INJECTIONS = ["x; touch {marker}", "x\ntouch {marker}", "$(touch {marker})", "`touch {marker}`", "x' ; touch {marker} #",
              'x" ; touch {marker} #', "x\rtouch {marker}", "x && touch {marker}", "x | touch {marker}"]
"""Values that would run `touch MARKER` if pasted into a script unquoted."""


def pipeline(*overrides):
    return load_pipeline([], ["train.launcher=slurm", *overrides])


@pytest.mark.parametrize("key", ["train.slurm_time", "train.slurm_partition", "train.slurm_extra.0"])
@pytest.mark.parametrize("template", INJECTIONS)
def test_slurm_keys_refuse_anything_but_their_format(key, template, tmp_path):
    value = template.format(marker=tmp_path / "pwned")
    overrides = ["train.slurm_extra=[--account=a]"] if key.endswith(".0") else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        pipeline(*overrides, f"{key}={json.dumps(value)}")


@pytest.mark.parametrize("key", ["train.out_dir", "targets.orin.description", "data.root", "name"])
def test_control_characters_are_refused_in_any_string(key):
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}: got .*control character '\\n'"):
        pipeline(f'{key}="x\\ntouch /tmp/pwned"')


@pytest.mark.parametrize("value, line", [
    ("12:00:00", "#SBATCH --time=12:00:00"), ("2-00:00:00", "#SBATCH --time=2-00:00:00"),
    ("90", "#SBATCH --time=90"), ("1:30", "#SBATCH --time=1:30"), ("UNLIMITED", "#SBATCH --time=UNLIMITED")])
def test_sbatch_time_forms_are_kept_as_written(value, line):
    """YAML 1.1 would read 12:00:00 as 43200 seconds and 1:30 as 90: both stay strings here."""
    # a 90-s limit needs the requeue signal sooner than the default 300 s before it (refused otherwise)
    assert line in sbatch_script(pipeline(f"train.slurm_time={value}", "train.slurm_signal_seconds=30"),
                                 ["true"]).splitlines()


def test_sbatch_time_in_a_yaml_file_is_not_sexagesimal(tmp_path):
    config = tmp_path / "slurm.yaml"
    config.write_text("train:\n  slurm_time: 12:00:00\n  slurm_partition: a100,h100\n")
    loaded = load_pipeline(["configs/pipeline.yaml", config])
    assert loaded.train.slurm_time == "12:00:00" and loaded.train.slurm_partition == "a100,h100"


@pytest.mark.parametrize("template", INJECTIONS[:1] + INJECTIONS[2:6] + ["a b/c d", "100% done"])
def test_a_hostile_legal_path_stays_one_argument_and_runs_nothing(template, tmp_path):
    marker = tmp_path / "pwned"
    out = tmp_path / template.format(marker=marker).replace("/", "_")
    workdir = tmp_path / ("work " + template.format(marker=marker).replace("/", "_"))
    workdir.mkdir()
    extra = f"--comment={'ok'}"
    program = [sys.executable, "-m", "stack", "train", f"train.out_dir={out}", "name=a b"]
    script = sbatch_script(pipeline(f"train.out_dir={json.dumps(str(out))}", f"train.slurm_extra=[{extra}]"),
                           program, workdir=workdir)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    sbatch_lines = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    parsed = [shlex.split(line[len("#SBATCH "):]) for line in sbatch_lines]  # sbatch's quoting rules
    assert all(len(words) == 1 for words in parsed), parsed
    assert [f"--output={str(out).replace('%', '%%')}/slurm-%j.out"] in parsed
    commands = [line for line in script.splitlines()[1:] if line and not line.startswith("#")]
    assert [c.split()[0] for c in commands] == ["set", "cd", "export", "srun"], commands
    argv = _run_with_fake_srun(path, tmp_path)
    assert not marker.exists()
    assert argv["cwd"] == str(workdir) and argv["args"][1:] == program


def _run_with_fake_srun(script: Path, tmp_path: Path) -> dict:
    """Run the script with an `srun` that records its arguments and working directory instead of starting tasks."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "srun.json"
    fake = bin_dir / "srun"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'cwd': os.getcwd(), 'args': sys.argv[1:]}}, open({str(record)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    return json.loads(record.read_text())


def test_a_backslash_in_out_dir_is_refused_for_slurm(tmp_path):
    from stack.errors import StackError

    with pytest.raises(StackError, match="backslash"):
        sbatch_script(pipeline(f"train.out_dir={json.dumps(str(tmp_path / 'a' / 'b'))}".replace("/b", "\\\\b")),
                      ["true"])


@pytest.mark.parametrize("name", ["../escape", "..", "a/b", "/abs", ".hidden", "x y", "x;y", "é"])
def test_target_names_from_a_config_file_are_identifiers(name, tmp_path):
    config = tmp_path / "targets.yaml"
    config.write_text(json.dumps({"targets": {name: {"description": "mine"}}}))
    before = sorted(tmp_path.rglob("*"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["deploy", "--target", name, str(tmp_path / "model.pt"), "-c", "configs/pipeline.yaml",
                     "-c", str(config), f"export.out_dir={tmp_path / 'export'}"])
    assert code == 2 and "target name" in err.getvalue(), err.getvalue()
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, inside export.out_dir or outside it
    with pytest.raises(ConfigError, match="a name is used as a folder"):
        load_pipeline(["configs/pipeline.yaml", config])
