"""Preemption-safe SLURM: the script's requeue/signal/resource lines, their quoting, the restart rule, and a real
job on the one-node cluster that is signalled, requeued twice and ends with the weights of an uninterrupted run."""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import OneNodeCluster, missing_tools  # noqa: E402
from standin import tiny_pipeline  # noqa: E402

from stack.cli import main as stack_main
from stack.errors import ConfigError
from stack.train import preemption
from stack.train.launch import sbatch_script

HERE = Path(__file__).resolve().parent


def _lines(pipeline, tmp_path):
    return sbatch_script(pipeline, ["python", "x.py"], workdir=tmp_path).splitlines()


def test_the_script_asks_for_requeue_and_a_signal_before_the_time_limit(tmp_path):
    lines = _lines(tiny_pipeline("train.slurm_signal_seconds=600"), tmp_path)
    for expected in ("#SBATCH --requeue", "#SBATCH --signal=USR1@600", "#SBATCH --open-mode=append"):
        assert expected in lines, expected
    off = _lines(tiny_pipeline("train.slurm_requeue=false"), tmp_path)
    assert not any(line.startswith(("#SBATCH --requeue", "#SBATCH --signal")) for line in off)
    assert "#SBATCH --open-mode=append" in off


def test_cpus_and_memory_reach_sbatch_and_srun(tmp_path):
    lines = _lines(tiny_pipeline("train.slurm_cpus_per_task=8", "train.slurm_mem=256G"), tmp_path)
    assert "#SBATCH --cpus-per-task=8" in lines and "#SBATCH --mem=256G" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--cpus-per-task=8" in srun  # Slurm >= 22.05: srun no longer inherits it from sbatch
    plain = "\n".join(_lines(tiny_pipeline(), tmp_path))
    assert "--cpus-per-task" not in plain and "--mem" not in plain and "--container" not in plain


def _stand_in(tmp_path: Path, tool: str, program: str) -> Path:
    """A folder to put first on PATH, holding an executable `tool` that runs `program` (a script with its #! line)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / tool).write_text(program)
    (bin_dir / tool).chmod(0o755)
    return bin_dir


def _srun_argv(script: str, tmp_path: Path) -> list[str]:
    """Run the script with bash, a stand-in `srun` on PATH recording the arguments it was given."""
    record = tmp_path / "srun-argv.json"
    bin_dir = _stand_in(tmp_path, "srun",
                        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    body = "\n".join(line for line in script.splitlines() if not line.startswith("#SBATCH"))
    subprocess.run(["bash", "-c", body], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, check=True,
                   cwd=tmp_path)
    return json.loads(record.read_text())


def test_a_container_path_with_spaces_and_semicolons_stays_one_argument(tmp_path):
    image = str(tmp_path / "images dir; touch pwned" / "torch $(id).sqsh")
    mounts = [f"{tmp_path}/data set;x:/data:ro", "/scratch:/scratch"]
    pipeline = tiny_pipeline(f"train.slurm_container_image={json.dumps(image)}",
                             f"train.slurm_container_mounts={json.dumps(mounts)}", "train.slurm_cpus_per_task=2")
    program = [sys.executable, "-m", "stack", "train", "-c", "/cfg dir/p;1.yaml", "train.launcher=local"]
    argv = _srun_argv(sbatch_script(pipeline, program, workdir=tmp_path), tmp_path)
    assert argv == ["--kill-on-bad-exit=1", "--cpus-per-task=2", f"--container-image={image}",
                    f"--container-workdir={tmp_path}", f"--container-mounts={','.join(mounts)}",
                    "python", "-m", "stack", "train", "-c", "/cfg dir/p;1.yaml", "train.launcher=local"]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("override, key", [
    ("train.slurm_mem='2 G'", "train.slurm_mem"),
    ("train.slurm_mem=16GB", "train.slurm_mem"),
    ("train.slurm_cpus_per_task=-1", "train.slurm_cpus_per_task"),
    ("train.slurm_signal_seconds=0", "train.slurm_signal_seconds"),
    ("train.slurm_container_image=--privileged", "train.slurm_container_image"),
    ("train.slurm_container_mounts=[data:/data]", "train.slurm_container_mounts.0"),
    ("train.slurm_container_mounts=['/a,/etc:/etc']", "train.slurm_container_mounts.0"),
    ("train.slurm_container_mounts=['/a:/b:ro:x']", "train.slurm_container_mounts.0"),
])
def test_malformed_slurm_values_are_refused_with_exit_2(override, key, capsys):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_pipeline(override)
    assert stack_main(["train", "train.launcher=slurm", override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{key}: got" in err  # the key, what was found, and (after it) what is expected


def test_a_signal_before_the_job_could_train_is_refused(capsys):
    """A 5-minute job told to stop 300 s before its limit would be requeued forever without a step."""
    with pytest.raises(ConfigError, match=r"slurm_signal_seconds: got 300 s with train\.slurm_time=5 \(300 s\)"):
        tiny_pipeline("train.slurm_time=5")
    assert stack_main(["train", "train.launcher=slurm", "train.slurm_time=0:04:00", "--dry-run"]) == 2
    assert "would be signalled and requeued before it trains" in capsys.readouterr().err
    tiny_pipeline("train.slurm_time=5", "train.slurm_signal_seconds=60")
    tiny_pipeline("train.slurm_time=5", "train.slurm_requeue=false")
    tiny_pipeline("train.slurm_time=UNLIMITED")


@pytest.mark.parametrize("requeued, code, label", [(True, 0, "requeued"), (False, 143, "stopped")])
def test_the_cli_reports_a_stop_for_requeue_as_such_not_as_an_error(capsys, monkeypatch, requeued, code, label):
    class Stops:
        @staticmethod
        def add_arguments(parser):
            pass

        @staticmethod
        def run(args):
            raise preemption.TrainingRequeued("stopped at step 12 on SIGUSR1 before the time limit", requeued)

    monkeypatch.setattr("stack.cli._command_module", lambda name: Stops)
    assert stack_main(["train"]) == code
    err = capsys.readouterr().err
    assert f"stack train: {label}: stopped at step 12" in err and "error" not in err


def _run_with_latest(tmp_path: Path, step: int) -> Path:
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / f"step-{step:07d}.ckpt").write_bytes(b"")
    (out / "checkpoints" / "latest").write_text(f"step-{step:07d}.ckpt\n")
    return out


def test_a_restarted_job_resumes_its_own_latest_and_never_overwrites_it(tmp_path, monkeypatch):
    out = _run_with_latest(tmp_path, 12)
    pipeline = tiny_pipeline(f"train.out_dir={out}", "train.overwrite=true", f"train.resume={tmp_path / 'other'}")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    resumed = preemption.resume_after_requeue(pipeline)
    assert resumed.train.resume == str(out) and resumed.train.overwrite is False
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert preemption.resume_after_requeue(pipeline) is pipeline  # a first run decides for itself, as before
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert preemption.resume_after_requeue(pipeline) is pipeline


def test_a_restarted_job_without_a_checkpoint_starts_as_it_first_did(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    pipeline = tiny_pipeline(f"train.out_dir={tmp_path / 'empty'}")
    assert preemption.resume_after_requeue(pipeline) is pipeline


def test_a_failed_requeue_is_reported_not_hidden(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'Requested operation is presently disabled for job 7' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    done, message = preemption._requeue()
    assert not done and "presently disabled" in message and "Resubmit" in message
    monkeypatch.setenv("SLURM_JOB_ID", "7; rm -rf /")
    assert preemption._requeue()[0] is False


def test_ranks_agree_on_a_signal_over_a_cpu_group_without_a_device_sync(monkeypatch):
    """A GPU run's per-step agreement must not all-reduce a device tensor and `.item()` it (a host sync every
    step): it runs over a gloo group on a CPU tensor. Here rank 1 got SIGUSR1; this rank did not, and still
    stops at the same step."""
    from types import SimpleNamespace

    import torch.distributed as dist

    def device_reduce(*args, **kwargs):
        raise AssertionError("agreed over the training strategy's (device) group")

    made, reduced = [], []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: made.append(kwargs) or "gloo-group")

    def all_reduce(tensor, op=None, group=None):
        reduced.append((tensor.device.type, op, group))
        tensor.fill_(max(float(tensor.item()), 1.0))  # the peer's SIGUSR1
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=device_reduce))
    module = SimpleNamespace(device=torch.device("cuda", 0))
    callback = preemption.RequeueOnSignal(checkpoints=None)
    callback.on_train_start(trainer, module)
    try:
        assert made == [{"backend": "gloo"}]
        assert callback._agreed_reason(trainer, module) == "SIGUSR1"
        assert reduced == [("cpu", dist.ReduceOp.MAX, "gloo-group")]
    finally:
        callback.teardown(trainer, module, "fit")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")  # CPU ranks: their own group is gloo
    callback.on_train_start(trainer, module)
    callback.teardown(trainer, module, "fit")
    assert len(made) == 1 and callback._group is None


# ----------------------------------------------------------------------------- the real cluster

STEPS, EVERY = 24, 4
OVERRIDES = ["train.max_epochs=10", f"train.max_steps={STEPS}", f"train.checkpoint_every_n_steps={EVERY}",
             "train.log_every_n_steps=1", "train.keep_checkpoints=2"]


def _latest_step(out: Path) -> int:
    pointer = out / "checkpoints" / "latest"
    try:
        return int(pointer.read_text().strip()[len("step-"):-len(".ckpt")])
    except (OSError, ValueError):
        return -1


CEILING_S = 600
"""The most a test here waits, in all, for the events it watches (checkpoints, requeues, the job's end). Each wait
ends as soon as its event happens (about a minute in all on an idle 2-core machine); the ceiling only ends a run
that hangs. It is generous because a loaded machine (a second job on both cores, fp32 steps on an AVX2 CPU)
stretches every start-up and step: a fixed 90 s for a restarted job to import torch, resume and checkpoint was
outlasted once. It stays below pytest's 900 s timeout, so the failure names what was awaited."""

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def _wait(condition, deadline: float, what: str, log: Path, gone=lambda: None) -> None:
    """Poll `condition` until it holds; fail at `deadline` (time.monotonic()), or at once when `gone()` says why the
    event can no longer happen."""
    while True:
        if condition():
            return
        reason = gone()
        if reason or time.monotonic() > deadline:
            why = reason or f"not seen in {CEILING_S} s (the test's ceiling)"
            raise AssertionError(f"gave up waiting for {what}: {why}; log:\n"
                                 f"{log.read_text()[-3000:] if log.exists() else '(none)'}")
        time.sleep(0.2)


def _job(cluster: OneNodeCluster, job: str) -> dict:
    shown = subprocess.run(["scontrol", "show", "job", job, "-o"], env=cluster.env, capture_output=True,
                           text=True).stdout
    return dict(item.split("=", 1) for item in shown.split() if "=" in item)


def _finished(cluster: OneNodeCluster, job: str):
    """For `_wait`: why the job can make no more progress (it ended), else None."""
    def reason():
        state = _job(cluster, job).get("JobState")
        return f"the job ended ({state})" if state in FINISHED else None
    return reason


def _start_now_when_requeued(cluster: OneNodeCluster, job: str, restarts: int, log: Path, deadline: float) -> None:
    """SLURM holds a requeued job for 2 minutes (BeginTime); the test lets it start as soon as SLURM can run it
    again. Not within the second it was killed in: slurmd revokes the killed run's credential with a resolution
    of one second and refuses a run launched in that second ("Job credential revoked"; the job then FAILS, which
    once looked like a slow restart). The kill came before the requeue this sees, so the next second is safe."""
    def requeued() -> bool:
        state = _job(cluster, job)
        return state.get("Restarts") == str(restarts) and state.get("JobState") == "PENDING"
    _wait(requeued, deadline, f"the job to be requeued ({restarts})", log, _finished(cluster, job))
    time.sleep(math.floor(time.time()) + 1.05 - time.time())
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster.env, check=True)


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.skipif(bool(missing_tools()), reason=f"needs SLURM and munge (make slurm); missing: {missing_tools()}")
def test_a_signalled_and_requeued_job_resumes_by_itself_to_the_uninterrupted_weights(tmp_path):
    """SIGUSR1 (as before the time limit): checkpoint, `scontrol requeue` from inside; then an outside `scontrol
    requeue` (SIGTERM, as preemption): checkpoint, SLURM requeues. Both restarts resume from `latest` with no
    flag, and the final weights equal, bit for bit, those of the same run trained without a stop."""
    reference = tmp_path / "reference"  # trained while the cluster starts
    uninterrupted = subprocess.Popen([sys.executable, str(HERE / "run_tiny.py"), f"train.out_dir={reference}",
                                      *OVERRIDES], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out = tmp_path / "run"
    out.mkdir()
    overrides = [f"train.out_dir={out}", *OVERRIDES, "train.slurm_time=10:00"]
    script = tmp_path / "job.sbatch"
    program = [sys.executable, str(HERE / "run_preemptible.py"), *overrides, "train.launcher=local"]
    script.write_text(sbatch_script(tiny_pipeline(*overrides), program))
    deadline = time.monotonic() + CEILING_S
    cluster = OneNodeCluster(tmp_path / "cluster").start()
    try:
        job = subprocess.run(["sbatch", "--parsable", str(script)], env=cluster.env, capture_output=True, text=True,
                             check=True).stdout.strip().split(";")[0]
        log, gone = out / f"slurm-{job}.out", _finished(cluster, job)
        _wait(lambda: _latest_step(out) >= EVERY, deadline, "the first checkpoint", log, gone)
        subprocess.run(["scancel", "--signal=USR1", job], env=cluster.env, check=True)
        _start_now_when_requeued(cluster, job, 1, log, deadline)
        first_stop = _latest_step(out)
        _wait(lambda: _latest_step(out) > first_stop, deadline, "a checkpoint after the first restart", log, gone)
        subprocess.run(["scontrol", "requeue", job], env=cluster.env, check=True)
        _start_now_when_requeued(cluster, job, 2, log, deadline)
        second_stop = _latest_step(out)
        _wait(lambda: gone() is not None, deadline, "the job to finish", log)
        state = _job(cluster, job)
    finally:
        cluster.stop()
        _, errors = uninterrupted.communicate(timeout=max(60.0, deadline - time.monotonic()))
    assert uninterrupted.returncode == 0, errors[-3000:]
    text = log.read_text()
    assert state["JobState"] == "COMPLETED", text[-3000:]
    assert text.count("stopped at step") == 2 and "on SIGUSR1 before the time limit" in text and "on SIGTERM" in text
    assert "SLURM restart 1 of job" in text and "SLURM restart 2 of job" in text, text[-3000:]
    assert EVERY <= first_stop < second_stop < STEPS, (first_stop, second_stop)
    assert "Traceback" not in text, text[-3000:]
    assert json.loads((out / "summary-rank0.json").read_text())["global_step"] == STEPS
    rows = [r for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get("train/loss_total")]
    assert [int(r["step"]) for r in rows] == list(range(STEPS))  # the stopping steps' rows were written too
    mine = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    theirs = torch.load(reference / "model.pt", weights_only=True)["state_dict"]
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), [k for k in mine if not torch.equal(mine[k], theirs[k])]


@pytest.mark.serial
@pytest.mark.slow
def test_sigusr1_under_slurm_checkpoints_at_a_step_boundary_and_requeues(tmp_path):
    """Without a cluster: the job's environment variables, a recording `scontrol`, and SIGUSR1 sent to the rank
    mid-run. It stops at a step boundary with that step's checkpoint as `latest`, asks SLURM to requeue job 4242,
    exits 0, and writes no model.pt (the run is not finished)."""
    calls = tmp_path / "scontrol-calls"
    bin_dir = _stand_in(tmp_path, "scontrol", f"#!/bin/sh\necho \"$@\" >> {str(calls)!r}\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
           "SLURM_JOB_NAME": "stack-train-test", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NODELIST": "localhost", "STACK_TEST_STEP_SECONDS": "0.3"}
    env.pop("SLURM_RESTART_COUNT", None)
    out = tmp_path / "run"
    rank = subprocess.Popen([sys.executable, str(HERE / "run_preemptible.py"), f"train.out_dir={out}", *OVERRIDES],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + CEILING_S
        _wait(lambda: _latest_step(out) >= EVERY, deadline, "the first checkpoint", out / "none",
              lambda: rank.poll() is not None and f"the rank exited ({rank.returncode})" or None)
        rank.send_signal(signal.SIGUSR1)
        _, errors = rank.communicate(timeout=max(60.0, deadline - time.monotonic()))
    finally:
        rank.kill()
    assert rank.returncode == 0, errors[-3000:]
    stop = _latest_step(out)
    assert EVERY <= stop < STEPS and f"stack train: stopped at step {stop} on SIGUSR1" in errors, errors[-3000:]
    assert f"requeued: step {stop} is checkpointed; requeued SLURM job 4242" in errors, errors[-3000:]
    assert calls.read_text().split() == ["requeue", "4242"]
    assert not (out / "model.pt").exists() and not (out / "summary-rank0.json").exists()
