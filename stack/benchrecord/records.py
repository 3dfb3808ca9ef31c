"""Bench records: one JSON file per `stack bench NAME --record` run, kept in a history folder.

A record holds what a later comparison needs to trust or refuse it:

    {"format": "stack-bench-record", "version": 1,
     "bench": "ops", "arguments": {"config": [...], "overrides": [...], "environment": {"OMP_NUM_THREADS": "2"}},
     "recorded_at": "2026-11-24T12:00:00Z", "exit_code": 0,
     "commit": {"sha": "b060a81...", "dirty": false},
     "machine": {"hardware": {"cpu", "isa", "cores", "gpu"}, "software": {"python", "torch", ...}},
     "pipeline": {"name": "tiny", "hash": "3f2a9c1b..."},
     "load": {"before": [1.02, 0.8, 0.5], "after": [2.1, 1.3, 0.7], "other_cpu": 0.02},   # stack.benchrecord.load
     "figures": [{"name", "unit", "lower_is_better", "floor", "samples": [...], "min", "median", "max"}]}

min/median/max are written for people and other tools; a reader recomputes them from the samples.
Records are JSON, never pickles: a record is data from whoever wrote the file. The history folder
defaults to `runs/bench-history/` beside the other runs (git ignores `runs/`); a record is written
whole or not at all (`stack.durable.write_atomic`), so a killed bench leaves no half record behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

from stack.benchrecord.figures import Figure, FigureLog
from stack.benchrecord.load import LOADED_OTHER_CPU
from stack.errors import StackError, missing_file_message

FORMAT = "stack-bench-record"
VERSION = 1
DEFAULT_HISTORY = Path("runs") / "bench-history"
"""Where records accumulate unless `--record PATH` / `--history DIR` say otherwise (relative to the working folder)."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
"""Environment variables that change what a bench measures; a record keeps those that were set."""
RECORD_AGAIN = "Give a record that `stack bench NAME --record` wrote, or record it again."



@dataclasses.dataclass(frozen=True)
class Record:
    bench: str
    arguments: dict
    commit: str
    dirty: bool | None
    """Uncommitted changes in the checkout; None where it is not a git checkout."""
    machine: dict
    pipeline: dict
    recorded_at: str
    """UTC, ISO 8601 to the second: records sort by it."""
    exit_code: int
    figures: dict[str, Figure]
    source: str = ""
    """The file it was read from ("" for a record not yet written)."""
    load: dict = dataclasses.field(default_factory=dict)
    """How busy the machine was with other work during the bench (`stack.benchrecord.load`): the load averages
    when it started and ended, and `other_cpu`, the share of the machine's CPU time that was not the bench's;
    {} for records written before it was kept."""

    @property
    def other_cpu(self) -> float | None:
        return self.load.get("other_cpu")

    def loaded(self) -> bool:
        """Other work took `LOADED_OTHER_CPU` of the machine's CPU time or more while the bench measured."""
        return self.other_cpu is not None and self.other_cpu >= LOADED_OTHER_CPU

    @property
    def hardware(self) -> dict:
        return self.machine.get("hardware", {})

    @property
    def label(self) -> str:
        """'b060a81c' or 'b060a81c+' (with uncommitted changes): how tables and plots name the commit."""
        return self.commit[:8] + ("+" if self.dirty else "")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "bench": self.bench, "arguments": self.arguments,
                "recorded_at": self.recorded_at, "exit_code": self.exit_code,
                "commit": {"sha": self.commit, "dirty": self.dirty}, "machine": self.machine,
                "pipeline": self.pipeline, "load": self.load,
                "figures": [_figure_json(f) for f in self.figures.values()]}


def _figure_json(figure: Figure) -> dict:
    samples = sorted(figure.samples)
    return {"name": figure.name, "unit": figure.unit, "lower_is_better": figure.lower_is_better,
            "floor": figure.floor, "samples": list(figure.samples), "min": samples[0], "median": figure.median,
            "max": samples[-1]}


# ----------------------------------------------------------------------------- writing


def build_record(bench: str, args, pipeline, figures: FigureLog, exit_code: int, load: dict | None = None) -> Record:
    """The record of a bench run that just finished: its figures, the code, the machine, the pipeline."""
    from stack.benchrecord.machine import fingerprint
    from stack.config import pipeline_hash
    from stack.lineage import git_commit

    sha, dirty = git_commit()
    arguments = {"config": [str(path) for path in args.config], "overrides": list(args.overrides),
                 "environment": {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ}}
    return Record(bench=bench, arguments=arguments, commit=sha, dirty={"true": True, "false": False}.get(dirty),
                  machine=fingerprint(), pipeline={"name": pipeline.name, "hash": pipeline_hash(pipeline)},
                  recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), exit_code=exit_code,
                  figures={figure.name: figure for figure in figures.figures},
                  load=load or {})


def check_destination(destination: Path) -> None:
    """Refuse a `--record PATH` that cannot be written, before the bench spends minutes measuring."""
    if "=" in destination.name:
        raise StackError(f"--record took {str(destination)!r} as the path to record to; it looks like a key=value "
                         f"override. Put overrides before --record, or give the path: --record runs/bench-history")
    folder = destination.parent if destination.suffix == ".json" else destination
    if destination.suffix != ".json" and destination.is_file():
        raise StackError(f"--record {str(destination)!r} is a file that is not a .json record; give a folder to "
                         f"collect records in (default {DEFAULT_HISTORY}) or a path ending in .json")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StackError(f"--record: cannot create the folder {str(folder)!r} ({exc.strerror}); give a writable "
                         f"folder or .json path") from None


def write_record(record: Record, destination: Path) -> Path:
    """Write `record` to `destination`: that file when it ends in .json, else a new file in that folder named
    `<recorded_at>-<bench>-<commit>.json`, so a folder's records list in time order."""
    from stack.durable import write_atomic

    check_destination(destination)
    path = destination if destination.suffix == ".json" else _new_name(destination, record)
    return write_atomic(path, (json.dumps(record.to_json(), indent=1) + "\n").encode())


def _new_name(folder: Path, record: Record) -> Path:
    stem = f"{record.recorded_at.replace(':', '').replace('-', '')}-{record.bench}-{record.commit[:8]}"
    path, count = folder / f"{stem}.json", 1
    while path.exists():
        count += 1
        path = folder / f"{stem}-{count}.json"
    return path


# ----------------------------------------------------------------------------- reading


def read_record(path: Path) -> Record:
    """The record at `path`; a StackError saying what was expected and found when it is missing or not one."""
    path = Path(path)
    if not path.is_file():
        raise StackError(missing_file_message("bench record", path, RECORD_AGAIN))
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise StackError(f"{path}: not a bench record: expected JSON text, found binary data. {RECORD_AGAIN}") from None
    except json.JSONDecodeError as exc:
        raise StackError(f"{path}: not a bench record: expected JSON, found invalid JSON at line {exc.lineno} "
                         f"column {exc.colno} ({exc.msg}); the file may be cut short. {RECORD_AGAIN}") from None
    return record_from_json(data, str(path))


def record_from_json(data, source: str) -> Record:
    """Validate the parsed JSON of a record, naming the first field that is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = f"format {data.get('format')!r}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise StackError(f"{source}: not a bench record: expected an object with format {FORMAT!r}, found {found}. "
                         f"{RECORD_AGAIN}")
    version = _field(data, "version", int, source)
    if version > VERSION:
        raise StackError(f"{source}: bench record version {version} was written by a newer stack; this one reads "
                         f"version {VERSION}. Compare it with the stack that wrote it.")
    commit = _field(data, "commit", dict, source)
    figures = [_figure(entry, f"{source}: figures[{i}]") for i, entry in enumerate(_field(data, "figures", list, source))]
    return Record(bench=_field(data, "bench", str, source), arguments=_field(data, "arguments", dict, source),
                  commit=_field(commit, "sha", str, f"{source}: commit"), dirty=commit.get("dirty"),
                  machine=_field(data, "machine", dict, source), pipeline=_field(data, "pipeline", dict, source),
                  recorded_at=_field(data, "recorded_at", str, source), exit_code=_field(data, "exit_code", int, source),
                  figures={figure.name: figure for figure in figures}, source=source, load=_load(data, source))


def _load(data: dict, source: str) -> dict:
    """The optional load entry: {} when absent (records written before it was kept)."""
    load = data.get("load", {})
    numbers = (int, float)
    valid = isinstance(load, dict) and all(
        (isinstance(value, list) and all(isinstance(x, numbers) and not isinstance(x, bool) for x in value))
        if key in ("before", "after") else (isinstance(value, numbers) and not isinstance(value, bool))
        for key, value in load.items())
    if not valid:
        raise StackError(f"{source}: expected 'load' to hold 'before'/'after' lists of numbers and an 'other_cpu' "
                         f"number, found {load!r}. {RECORD_AGAIN}")
    return {key: [float(x) for x in value] if isinstance(value, list) else float(value) for key, value in load.items()}


def _figure(entry, where: str) -> Figure:
    if not isinstance(entry, dict):
        raise StackError(f"{where}: expected an object, found {type(entry).__name__}. {RECORD_AGAIN}")
    samples = _field(entry, "samples", list, where)
    floor = entry.get("floor")
    try:
        return Figure(_field(entry, "name", str, where), tuple(float(s) for s in samples), _field(entry, "unit", str, where),
                      bool(entry.get("lower_is_better", True)), None if floor is None else float(floor))
    except (TypeError, ValueError) as exc:
        raise StackError(f"{where}: expected finite numbers for samples and floor: {exc}. {RECORD_AGAIN}") from None


def _field(data: dict, key: str, kind: type, where: str):
    value = data.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise StackError(f"{where}: expected {key!r} to be a {kind.__name__}, found {value!r}. {RECORD_AGAIN}")
    return value


def load_history(folder: Path) -> list[Record]:
    """Every record in `folder` (its *.json files), oldest first; a StackError naming any file that is not one."""
    folder = Path(folder)
    if folder.is_file():
        raise StackError(f"--history {str(folder)!r} is a file; expected the folder of records. To judge that record "
                         f"against the history, name it before the flag: stack bench compare {folder} --history")
    if not folder.is_dir():
        raise StackError(missing_file_message("bench history folder", folder,
                                              "Record into it first: stack bench NAME --record (default folder "
                                              f"{DEFAULT_HISTORY}), or give the folder: --history DIR"))
    records = [read_record(path) for path in sorted(folder.glob("*.json"))]
    if not records:
        raise StackError(f"the bench history folder {str(folder)!r} holds no records (*.json). Record into it: "
                         f"stack bench NAME --record {folder}")
    return sorted(records, key=lambda record: record.recorded_at)


def in_commit_order(records: list[Record], repository: Path | None = None) -> tuple[list[Record], str]:
    """The records by where their commit sits in the checkout's history (oldest commit first, `git rev-list
    --topo-order`), each commit's records by time; and a line saying which order was used.

    A history recorded out of commit order (old commits measured today, as asv measures a range; a commit
    measured again later to pool its runs) must still read in the order the code changed, or step detection
    splits between the wrong neighbours. Time order where git cannot place every record's commit (not a checkout,
    or a commit this checkout's history does not hold)."""
    repository = Path(repository) if repository is not None else Path(__file__).resolve().parent
    try:
        listed = subprocess.run(["git", "-C", str(repository), "rev-list", "--topo-order", "--reverse", "HEAD"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        listed = None
    position = {sha: index for index, sha in enumerate(listed.stdout.split())} if listed and listed.returncode == 0 \
        else {}
    unknown = sorted({record.commit[:8] for record in records if record.commit not in position})
    if unknown:
        return records, (f"order: by time (commits {', '.join(unknown)} are not in the history of "
                         f"{repository}{'' if position else ', not a git checkout'})")
    ordered = sorted(records, key=lambda record: (position[record.commit], record.recorded_at))
    return ordered, f"order: by commit, as the history of {repository} has them"
