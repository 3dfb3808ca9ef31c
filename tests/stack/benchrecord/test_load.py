"""How busy other work kept the machine during a bench: counted from the kernel's CPU time, minus the bench's own."""

import subprocess
import sys
import time

import pytest

from stack.benchrecord import load
from stack.benchrecord.load import LoadMeter


def test_other_cpu_is_the_machines_busy_time_less_the_benchs_own(monkeypatch):
    """4 s of wall on 2 CPUs is 8 CPU-seconds; the machine was busy 5 of them, 3 of which were the bench's."""
    clock, busy, own = iter([10.0, 14.0]), iter([(100.0, 2), (105.0, 2)]), iter([1.0, 4.0])
    monkeypatch.setattr(load.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(load, "machine_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(load, "own_cpu_seconds", lambda: next(own))
    entry = LoadMeter().finish()
    assert entry["other_cpu"] == pytest.approx(2.0 / 8.0)


@pytest.mark.skipif(load.machine_busy_seconds() is None, reason="no /proc/stat on this system")
def test_a_busy_neighbour_is_seen_and_the_benchs_own_work_is_not_counted():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # the neighbour is running before the bench starts
        meter = LoadMeter()
        deadline = time.perf_counter() + 1.5
        while time.perf_counter() < deadline:  # the bench's own work: one busy core
            pass
        entry = meter.finish()
    finally:
        neighbour.kill()
        neighbour.wait()
    cpus = load.machine_busy_seconds()[1]
    # The neighbour holds a core (shared with the bench and any other test: at least a third of one), never
    # the bench's own loop; more load elsewhere only adds to it.
    assert entry["other_cpu"] >= 0.3 / cpus
    assert len(entry["before"]) == 3 and len(entry["after"]) == 3
