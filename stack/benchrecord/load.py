"""What else ran on the machine while a bench measured: the evidence for setting a record aside.

On a shared 2-core machine another job moves every sample of a run together
(docs/log/2026-11-28_history-over-commits.md), so a record keeps how busy the machine was with work that was
not the bench's own:

    other_cpu = (CPU time the whole machine spent busy - CPU time of this process and its children)
                / (wall time x CPUs)

from the kernel's per-CPU counters (/proc/stat: user, nice, system, irq, softirq, steal) and getrusage. The
load average is kept too for people, but it cannot judge a run: a bench queued right after another starts
at the previous one's load (the 1-minute average decays over a minute), while the CPU-time share counts only
what ran beside it.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

LOADED_OTHER_CPU = 0.10
"""A run during which other work took this share of the machine's CPU time or more is 'loaded'."""
PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""user, nice, system, irq, softirq, steal in /proc/stat's `cpu` line (guest time is inside user)."""


def machine_busy_seconds() -> tuple[float, int] | None:
    """(CPU-seconds all CPUs of the machine have spent busy since boot, how many CPUs /proc/stat counts), or None
    where /proc/stat is missing."""
    try:
        lines = PROC_STAT.read_text().splitlines()
        fields = lines[0].split()[1:]
    except (OSError, IndexError):
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields)) / os.sysconf("SC_CLK_TCK"), max(cpus, 1)


def own_cpu_seconds() -> float:
    """CPU-seconds of this process and of its children that have been waited for (data workers, torchrun ranks)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_average() -> list[float] | None:
    """os.getloadavg() (1, 5, 15 min), or None where the system has none."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


class LoadMeter:
    """Started before a bench measures, `finish()`ed after: the record's `load` entry."""

    def __init__(self):
        self.before = load_average()
        self.busy = machine_busy_seconds()
        self.own = own_cpu_seconds()
        self.wall = time.perf_counter()

    def finish(self) -> dict:
        entry = {key: value for key, value in (("before", self.before), ("after", load_average())) if value}
        busy, wall = machine_busy_seconds(), time.perf_counter() - self.wall
        if busy is not None and self.busy is not None and wall > 0:
            other = (busy[0] - self.busy[0]) - (own_cpu_seconds() - self.own)
            entry["other_cpu"] = round(min(1.0, max(0.0, other / (wall * busy[1]))), 3)
        return entry
