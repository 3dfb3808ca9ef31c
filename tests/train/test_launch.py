"""SLURM and torchrun launchers: the generated script, and a real 2-task job on a private one-node cluster."""

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import OneNodeCluster, missing_tools  # noqa: E402
from standin import tiny_pipeline  # noqa: E402

from stack.train.launch import rank_command, sbatch_script, torchrun_command

SCRIPT = Path(__file__).resolve().parent / "run_tiny.py"


def test_sbatch_script_runs_the_same_command_under_srun(tmp_path):
    pipeline = tiny_pipeline("train.launcher=slurm", "train.num_nodes=4", "train.devices=8", "train.accelerator=gpu",
                             "train.slurm_partition=a100", "train.slurm_extra=[--account=perception]",
                             f"train.out_dir={tmp_path}/run")
    program = rank_command(["configs/pipeline.yaml"], ["train.launcher=slurm", "train.num_nodes=4", "train.lr=0.001"])
    script = sbatch_script(pipeline, program, workdir=tmp_path)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for expected in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --partition=a100", "#SBATCH --account=perception", "#SBATCH --time=04:00:00",
                     f"#SBATCH --output={tmp_path}/run/slurm-%j.out", f"cd {tmp_path}"):
        assert expected in lines, expected
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1
    config = str(Path("configs/pipeline.yaml").resolve())
    assert srun[0].endswith(f"-m stack train -c {config} train.num_nodes=4 train.lr=0.001 train.launcher=local")
    assert "launcher=slurm" not in srun[0]  # the ranks run locally; nothing submits again


def test_cpu_jobs_ask_for_no_gpus(tmp_path):
    script = sbatch_script(tiny_pipeline("train.devices=2"), ["python", "x.py"], workdir=tmp_path)
    assert "--gpus-per-node" not in script and "#SBATCH --ntasks-per-node=2" in script


def test_torchrun_command_uses_a_c10d_rendezvous():
    pipeline = tiny_pipeline("train.num_nodes=2", "train.devices=4", "train.rendezvous=node001:29400")
    command = torchrun_command(pipeline, rank_command([], ["train.launcher=torchrun"]))
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node001:29400"} <= set(command)
    assert command[-4:] == ["-m", "stack", "train", "train.launcher=local"]


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.skipif(bool(missing_tools()), reason=f"needs SLURM and munge (make slurm); missing: {missing_tools()}")
def test_two_task_job_on_a_one_node_slurm_cluster(tmp_path):
    out = tmp_path / "run"
    overrides = [f"train.out_dir={out}", "train.devices=2", "train.strategy=ddp", "train.max_steps=3",
                 "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=3"]
    pipeline = tiny_pipeline(*overrides)
    program = [sys.executable, str(SCRIPT), *overrides, "train.launcher=local"]
    script = tmp_path / "job.sbatch"
    out.mkdir()
    script.write_text(sbatch_script(pipeline, program))
    cluster = OneNodeCluster(tmp_path / "cluster").start()
    try:
        job = cluster.run_job(script)
    finally:
        cluster.stop()
    log = out / f"slurm-{job['JobId']}.out"
    assert job["JobState"] == "COMPLETED", log.read_text()[-3000:] if log.exists() else job
    ranks = [json.loads((out / f"summary-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["global_step"] for r in ranks] == [3, 3]
    assert (out / "checkpoints" / "step-0000003.ckpt" / ".metadata").is_file()
    assert len([r for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get("train/loss_total")]) == 3


@pytest.mark.serial
@pytest.mark.skipif(bool(missing_tools()), reason=f"needs SLURM and munge (make slurm); missing: {missing_tools()}")
def test_sbatch_reads_a_hostile_out_dir_as_one_path(tmp_path):
    """A real sbatch parses the quoted #SBATCH --output: the log lands in the folder named by a path with
    spaces, quotes, `$(...)`, `;` and `%`, and the job runs the program with its arguments intact, nothing else."""
    marker = tmp_path / "pwned"
    out = tmp_path / f"run 100% 'q' \"d\" $(touch {marker.name}); x"
    out.mkdir()
    record = tmp_path / "argv.json"
    program = [sys.executable, "-c", "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))",
               str(record), "a b", "$(touch pwned)"]
    pipeline = tiny_pipeline(f"train.out_dir={json.dumps(str(out))}", "train.slurm_time=0:10:00")
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(pipeline, program, workdir=tmp_path))
    cluster = OneNodeCluster(tmp_path / "cluster").start()
    try:
        job = cluster.run_job(script)
    finally:
        cluster.stop()
    assert job["JobState"] == "COMPLETED", job
    assert (out / f"slurm-{job['JobId']}.out").is_file(), sorted(p.name for p in tmp_path.rglob("slurm-*"))
    assert json.loads(record.read_text()) == program[3:]
    assert not marker.exists() and not (tmp_path / "pwned").exists()
