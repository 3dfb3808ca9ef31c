"""Run the workloads under callgrind and read its dumps into per-stage, per-function counts.

Why callgrind and not a clock: on our shared 2-core machines a timing moves 10-30% from run to run, while
the instructions a fixed single-threaded workload executes under valgrind's simulated CPU repeat exactly, so
a 3% rule neither cries wolf nor sleeps (the approach CodSpeed takes to CI benchmarks: codspeed.io/docs,
"CPU simulation"). Hardware counters (`perf stat`) would do without the 50x slowdown but are absent in the VMs
we run on. Callgrind rather than cachegrind: valgrind 3.19 (Debian 12) gives only callgrind the client
requests that switch instrumentation on after `import torch` and dump a profile per stage.

Fixed cache geometry (`CACHE`) rather than the host's: callgrind's default copies the host's caches, so the
simulated misses would change with the CPU model of the day. Under valgrind the guest CPU is valgrind's own
(no AVX-512 on any host: the kernels run their AVX2 clones), which is the "level" the baseline is kept for.
Sources: valgrind.org/docs/manual/cl-manual.html (options, client requests) and cl-format.html (the file
format read by `read_dump`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stack.errors import StackError

EVENTS = ("Ir", "D1mr", "D1mw", "DLmr", "DLmw")
"""What a profile keeps of callgrind's events: instructions, first-level and last-level data cache misses."""
CACHE = ("--I1=32768,8,64", "--D1=32768,8,64", "--LL=8388608,16,64")
"""A fixed simulated cache (32 KiB 8-way L1s, 8 MiB 16-way last level), the same on every host."""
INSTALL = ("valgrind is not installed: the instruction-count check runs the workloads under it. "
           "Install it with `apt-get install valgrind` (Debian/Ubuntu; `make install` does) and run again.")
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
EMULATION_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE",
                 "NPY_DISABLE_CPU_FEATURES", "STACK_EMULATED_CPU")
"""Settings of `pytest --emulate-cpu` that would make a run count another level's kernels: removed."""


@dataclasses.dataclass
class Profile:
    """One run's counts: stage -> function -> event counts (self cost), and the ISA level it ran at."""

    level: dict
    stages: dict[str, dict[str, list[int]]]

    def total(self, stage: str, event: str = "Ir") -> int:
        index = EVENTS.index(event)
        return sum(costs[index] for costs in self.stages[stage].values())


def require_tools() -> tuple[str, str]:
    """(valgrind, C compiler) paths, or a StackError that says how to install what is missing."""
    valgrind = shutil.which("valgrind")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not valgrind or not Path("/usr/include/valgrind/callgrind.h").is_file():
        raise StackError(INSTALL)
    if not compiler:
        raise StackError("no C compiler (cc/gcc) found: the check compiles its callgrind client requests "
                         "(stack/instructions/marks.c). Install gcc and run again.")
    return valgrind, compiler


def build_marks(compiler: str, folder: Path) -> Path:
    """marks.c compiled into `folder` (a fraction of a second; not cached, so it always matches the source)."""
    library = folder / "libstackmarks.so"
    source = Path(__file__).with_name("marks.c")
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def run_workloads(scale: int = 1, workloads: str = "bev_pool,render") -> Profile:
    """Run `stack.instructions.workloads` under callgrind (one thread, fixed cache) and read its stage dumps."""
    valgrind, compiler = require_tools()
    with tempfile.TemporaryDirectory(prefix="stack-instructions-") as tmp:
        folder = Path(tmp)
        library, level_file = build_marks(compiler, folder), folder / "level.json"
        command = [valgrind, "--tool=callgrind", "--instr-atstart=no", "--cache-sim=yes", *CACHE,
                   "--compress-strings=no", "--compress-pos=no", f"--callgrind-out-file={folder}/callgrind.out",
                   sys.executable, "-m", "stack.instructions.workloads", str(library), str(level_file),
                   "--scale", str(scale), "--workloads", workloads]
        env = {key: value for key, value in os.environ.items() if key not in EMULATION_ENV} | THREAD_ENV
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the workloads failed under callgrind (exit {done.returncode}):\n{done.stderr[-4000:]}")
        stages: dict[str, dict[str, list[int]]] = {}
        for dump in sorted(folder.glob("callgrind.out.*")):
            stage, functions = read_dump(dump.read_text(errors="replace"))
            if stage is not None:
                merge(stages.setdefault(stage, {}), functions)
        return Profile(json.loads(level_file.read_text()), stages)


def merge(into: dict[str, list[int]], functions: dict[str, list[int]]) -> None:
    """Add one dump's per-function costs to a stage's (a stage dumped several times is their sum)."""
    for name, costs in functions.items():
        total = into.setdefault(name, [0] * len(EVENTS))
        for i, value in enumerate(costs):
            total[i] += value


def read_dump(text: str) -> tuple[str | None, dict[str, list[int]]]:
    """(stage, {function: self costs in EVENTS order}) of one callgrind dump written with --compress-strings=no
    --compress-pos=no. The stage is the name given to CALLGRIND_DUMP_STATS_AT (None for other dumps, such as the
    one at exit). A function is named `name [object file]`. Call lines (`calls=`) and the cost line after each
    hold inclusive costs of the callee: skipped, so a function's cost is its own instructions only."""
    stage, columns, functions = None, [], {}
    obj, function, skip_next = "", None, False
    for line in text.splitlines():
        if skip_next:
            skip_next = False
            continue
        if line[:1].isdigit():
            if function is not None:
                add_costs(functions.setdefault(function, [0] * len(EVENTS)), columns, line.split()[1:])
        elif line.startswith("calls="):
            skip_next = True
        elif line.startswith("ob="):
            obj = Path(line[3:]).name
        elif line.startswith("fn="):
            function = f"{line[3:]} [{obj}]"
        elif line.startswith("events:"):
            columns = [EVENTS.index(e) if e in EVENTS else -1 for e in line.split()[1:]]
        elif line.startswith("desc: Trigger: Client Request: "):
            stage = line.split("Client Request: ", 1)[1].strip()
    return stage, functions


def add_costs(total: list[int], columns: list[int], values: list[str]) -> None:
    for column, value in zip(columns, values):
        if column >= 0:
            total[column] += int(value)
