"""A private one-node SLURM cluster (munged + slurmctld + slurmd on localhost) for tests.

Everything lives in one temporary folder — munge key and socket, slurm.conf, state
and spool, logs — and `SLURM_CONF` points the clients at it, so nothing in /etc is
touched and no systemd is needed. The daemons run in the foreground as child
processes whose PIDs are kept; `stop()` shuts slurm down with `scontrol shutdown`
and ends those processes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if not shutil.which(tool)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line() -> str:
    """This machine's NodeName line from `slurmd -C`, renamed to localhost."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    fields = [f for f in line.split() if f.split("=")[0] in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket",
                                                             "ThreadsPerCore", "RealMemory")]
    return "NodeName=localhost " + " ".join(fields) + " State=UNKNOWN"


class OneNodeCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.processes: list[subprocess.Popen] = []

    def start(self, timeout: float = 60) -> "OneNodeCluster":
        root = self.root
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "munge", 0o755)  # munged refuses a socket folder others can write to
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.socket = root / "munge" / "munge.socket"
        self._spawn(["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.socket}",
                     f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
                     f"--seed-file={root / 'munge' / 'munged.seed'}"])
        self._wait_for(lambda: self.socket.exists(), timeout, "munged socket")
        self.conf.write_text(self._config())
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn(["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)])
        self._wait_for(self._node_ready, timeout, "slurmd to register as idle")
        return self

    def _config(self) -> str:
        r = self.root
        return "\n".join([
            "ClusterName=stacktest", "SlurmctldHost=localhost", "AuthType=auth/munge",
            f"AuthInfo=socket={self.socket}", "CredType=cred/munge", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MailProg=/bin/true", "ReturnToService=2",
            "MpiDefault=none", "SlurmdTimeout=60", "InactiveLimit=0", "KillWait=5",
            _node_line(), "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""])

    def _spawn(self, command: list[str]) -> None:
        log = open(self.root / "log" / f"{Path(command[0]).name}.stdout", "w")
        self.processes.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _node_ready(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True).stdout
        return out.strip() == "idle"

    def _wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if any(p.poll() is not None for p in self.processes):
                break
            time.sleep(0.25)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((self.root / "log").iterdir()))
        raise RuntimeError(f"SLURM test cluster: gave up waiting for {what}\n{logs}")

    def run_job(self, script: Path, timeout: float = 600) -> dict:
        """Submit `script`, wait for it to finish; returns scontrol's fields of the finished job. The wait ends
        when the job does; `timeout` only ends one that hangs, and is generous for a loaded machine."""
        job = subprocess.run(["sbatch", "--parsable", str(script)], env=self.env, capture_output=True, text=True,
                             check=True).stdout.strip().split(";")[0]
        state: dict = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = subprocess.run(["scontrol", "show", "job", job, "-o"], env=self.env, capture_output=True,
                                   text=True).stdout
            state = dict(item.split("=", 1) for item in shown.split() if "=" in item)
            if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return {"JobId": job, **state}
            time.sleep(0.5)
        subprocess.run(["scancel", job], env=self.env)
        raise RuntimeError(f"SLURM job {job} did not finish in {timeout}s (last state {state.get('JobState')})")

    def stop(self) -> None:
        subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=30)
        munged, *slurm_daemons = self.processes
        for process in slurm_daemons:
            _end(process, grace=15)
        munged.terminate()
        _end(munged, grace=5)


def _end(process: subprocess.Popen, grace: float) -> None:
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
