"""Running the same training command beyond one machine: SLURM (sbatch + srun) and torchrun.

`launcher=slurm` writes an sbatch script that starts `devices` tasks on each of
`num_nodes` nodes with `srun`, each running the very command the user typed with
`train.launcher=local`; Lightning's `SLURMEnvironment` reads the ranks from srun's
variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS) and the master
address from the node list. The script is submitted with `sbatch`, or printed with
`--dry-run`. `launcher=torchrun` runs `torchrun` with a c10d rendezvous at
`train.rendezvous`; running the same command on every node forms the job, and
Lightning's `TorchElasticEnvironment` picks up the ranks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from stack.errors import StackError
from stack.pipeline import Pipeline

LOCAL = "train.launcher=local"


def rank_command(config_files: Sequence[str], overrides: Sequence[str], command: str = "train") -> list[str]:
    """`python -m stack COMMAND -c ... overrides train.launcher=local`, with absolute config paths."""
    files = [arg for path in config_files for arg in ("-c", str(Path(path).resolve()))]
    kept = [o for o in overrides if not o.replace(" ", "").startswith("train.launcher=")]
    return [sys.executable, "-m", "stack", command, *files, *kept, LOCAL]


def sbatch_script(pipeline: Pipeline, program: Sequence[str], workdir: str | Path | None = None) -> str:
    """The sbatch script that runs `program` once per task under srun.

    Every value is quoted (`shlex.quote`): bash runs the script, and sbatch reads the
    `#SBATCH` lines with the same quoting rules (single and double quotes group, a
    backslash escapes; Slurm's src/sbatch/opt.c `_get_argument`). The schema has already
    refused control characters and checked the SLURM keys' formats (`stack.safe_values`).
    """
    train = pipeline.train
    log = _sbatch_filename(Path(train.out_dir).resolve() / "slurm-%j.out")
    lines = ["#!/bin/bash",
             _sbatch("--job-name", _job_name(pipeline)),
             _sbatch("--nodes", train.num_nodes),
             _sbatch("--ntasks-per-node", train.devices),
             _sbatch("--time", train.slurm_time),
             f"#SBATCH --output={shlex.quote(log)}"]
    if train.accelerator == "gpu":
        lines.append(_sbatch("--gpus-per-node", train.devices))
    if train.slurm_partition:
        lines.append(_sbatch("--partition", train.slurm_partition))
    lines += _resource_lines(train)
    lines += [_sbatch(*option.split("=", 1)) for option in train.slurm_extra]
    folder = str(Path(workdir or os.getcwd()).resolve())
    lines += ["", "set -euo pipefail", f"cd {shlex.quote(folder)}",
              "export PYTHONUNBUFFERED=1",
              "# One task per rank; Lightning's SLURMEnvironment reads the ranks from srun.",
              shlex.join(["srun", *_srun_options(train, folder), *_in_container(train, program)]), ""]
    return "\n".join(lines)


def _resource_lines(train) -> list[str]:
    """--requeue/--signal (stack.train.preemption), --open-mode, --cpus-per-task and --mem.

    `--signal=USR1@N` without `B:` goes to every task of the running step (each rank), not to the
    batch shell, which would have to trap it and forward it to srun's tasks itself; the ranks
    then agree on the step to stop at. `scancel --signal=USR1 JOB` reaches the same processes.
    `--open-mode=append` keeps the first attempt's log when the requeued job writes slurm-%j.out again."""
    lines = [_sbatch("--open-mode", "append")]
    if train.slurm_requeue:
        lines += [_sbatch("--requeue"), _sbatch("--signal", f"USR1@{train.slurm_signal_seconds}")]
    if train.slurm_cpus_per_task:
        lines.append(_sbatch("--cpus-per-task", train.slurm_cpus_per_task))
    if train.slurm_mem:
        lines.append(_sbatch("--mem", train.slurm_mem))
    return lines


def _srun_options(train, folder: str) -> list[str]:
    """srun's own options. Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task, so it is
    repeated; the pyxis options put the ranks (not the batch shell) into the container."""
    options = ["--kill-on-bad-exit=1"]
    if train.slurm_cpus_per_task:
        options.append(f"--cpus-per-task={train.slurm_cpus_per_task}")
    if train.slurm_container_image:
        options += [f"--container-image={train.slurm_container_image}", f"--container-workdir={folder}"]
        if train.slurm_container_mounts:
            options.append(f"--container-mounts={','.join(train.slurm_container_mounts)}")
    return options


def _in_container(train, program: Sequence[str]) -> list[str]:
    """`program`, with the host's interpreter path replaced by the image's `python` inside a container."""
    if train.slurm_container_image and program and program[0] == sys.executable:
        return ["python", *program[1:]]
    return list(program)


def _sbatch(option: str, value: object = None) -> str:
    """One `#SBATCH --option=value` line, the value quoted."""
    return f"#SBATCH {option}" if value is None else f"#SBATCH {option}={shlex.quote(str(value))}"


def _sbatch_filename(path: Path) -> str:
    """`path` as an sbatch filename pattern: '%' in the folder doubled (sbatch expands %j, %%...), the
    `%j` of the file name kept; a backslash, which sbatch's #SBATCH parser drops, is refused."""
    if "\\" in str(path):
        raise StackError(f"train.out_dir {str(path.parent)!r} holds a backslash, which sbatch's #SBATCH parser "
                         f"drops; use a folder without one for launcher=slurm.")
    return str(path.parent).replace("%", "%%") + "/" + path.name


def _job_name(pipeline: Pipeline) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"stack-train-{pipeline.name}")


def submit_slurm(pipeline: Pipeline, program: Sequence[str], dry_run: bool) -> int:
    """Write the sbatch script under out_dir/slurm/ and submit it (or print it with --dry-run)."""
    script = sbatch_script(pipeline, program)
    folder = Path(pipeline.train.out_dir) / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"train-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(script)
    if dry_run:
        print(script, end="")
        print(f"# written to {path}; submit with: sbatch {shlex.quote(str(path))}", file=sys.stderr)
        return 0
    sbatch = _require("sbatch", "launcher=slurm submits with sbatch")
    result = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"sbatch refused {path}: {result.stderr.strip() or result.stdout.strip()}. "
                         f"Check train.slurm_partition / train.slurm_extra, or run with --dry-run to inspect.")
    job = result.stdout.strip().split(";")[0]
    print(f"submitted SLURM job {job}: {path}\nlog: {Path(pipeline.train.out_dir).resolve()}/slurm-{job}.out")
    return 0


def torchrun_command(pipeline: Pipeline, program: Sequence[str]) -> list[str]:
    """`torchrun` with a c10d rendezvous running `program` (a `python -m ...` or script command) per rank."""
    train = pipeline.train
    if len(program) > 2 and program[1] == "-m":
        target = ["-m", *program[2:]]
    else:
        target = list(program[1:])
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={train.num_nodes}",
            f"--nproc-per-node={train.devices}", "--rdzv-backend=c10d", f"--rdzv-endpoint={train.rendezvous}",
            f"--rdzv-id={_job_name(pipeline)}", *target]


def run_torchrun(pipeline: Pipeline, program: Sequence[str], dry_run: bool) -> int:
    command = torchrun_command(pipeline, program)
    if dry_run or pipeline.train.num_nodes > 1:
        print(shlex.join(command))
        if pipeline.train.num_nodes > 1 and not dry_run:
            print(f"# run this same command on each of the {pipeline.train.num_nodes} nodes "
                  f"(rendezvous at {pipeline.train.rendezvous}); starting this node's ranks now", file=sys.stderr)
        if dry_run:
            return 0
    return subprocess.run(command).returncode


def local_dry_run(pipeline: Pipeline, program: Sequence[str]) -> int:
    """`--dry-run` with train.launcher=local: print the command that trains and what it would train, as the other
    launchers print theirs; nothing is trained and nothing is written (not even train.out_dir)."""
    from stack.config import pipeline_hash

    train = pipeline.train
    steps = f"{train.max_steps} steps" if train.max_steps > 0 else f"{train.max_epochs} epochs"
    print(shlex.join(program))
    print(f"# would train {pipeline.name} (pipeline {pipeline_hash(pipeline)[:12]}) on {pipeline.data.root} for "
          f"{steps}: {train.devices} device(s) x {train.num_nodes} node(s), strategy {train.strategy}, precision "
          f"{train.precision}, into {train.out_dir}" + (f", resuming {train.resume}" if train.resume else "")
          + "; dry run: nothing trained or written", file=sys.stderr)
    return 0


def _require(tool: str, why: str) -> str:
    found = shutil.which(tool)
    if not found:
        raise StackError(f"{why}, but `{tool}` is not on PATH. Run on a SLURM login node, or use --dry-run "
                         f"to write the script only.")
    return found
