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
Records are JSON, never pickles: a record is data from whoever wrote the file, so it is read through the
bounded reader (`stack.user_json`), every field's type is checked, `bench` must be a name (it names the
history's trend folder) and a figure holds at most `MAX_SAMPLES` samples. The history folder defaults to
`runs/bench-history/` beside the other runs (git ignores `runs/`); a record is written whole or not at all
(`stack.durable.write_atomic`), so a killed bench leaves no half record behind, and `--record PATH` never
replaces a file that is not a record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

from stack.benchrecord.figures import MAX_SAMPLES, Figure, FigureLog
from stack.benchrecord.load import LOADED_OTHER_CPU
from stack.errors import StackError, missing_file_message
from stack.failpoints import fail_point
from stack.safe_values import escaped, identifier

FORMAT = "stack-bench-record"
VERSION = 1
DEFAULT_HISTORY = Path("runs") / "bench-history"
"""Where records accumulate unless `--record PATH` / `--history DIR` say otherwise (relative to the working folder)."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
"""Environment variables that change what a bench measures; a record keeps those that were set."""
RECORD_AGAIN = "Give a record that `stack bench NAME --record` wrote, or record it again."
MAX_FIGURES = 1_000
"""Most figures a record may hold on read (each is a test and a trend PNG); the ops bench writes the most, about a
hundred (11 variants x 3 thread settings x its cases)."""


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
    """Refuse a `--record PATH` that cannot be written, or whose writing would replace a file of the user's, before
    the bench spends minutes measuring. An existing folder collects records whatever its name."""
    destination = Path(destination)
    if "=" in destination.name:
        raise StackError(f"--record took {escaped(str(destination))!r} as the path to record to; it looks like a "
                         f"key=value override. Put overrides before --record, or give the path: --record "
                         f"runs/bench-history")
    file = destination.suffix == ".json" and not destination.is_dir()
    if not file and destination.is_file():
        raise StackError(f"--record {escaped(str(destination))!r} is a file that is not a .json record; give a folder "
                         f"to collect records in (default {DEFAULT_HISTORY}) or a path ending in .json")
    if file and (destination.exists() or destination.is_symlink()):
        _refuse_to_overwrite(destination)
    folder = destination.parent if file else destination
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StackError(f"--record: cannot create the folder {escaped(str(folder))!r} ({exc.strerror}); give a "
                         f"writable folder or .json path") from None


def _refuse_to_overwrite(path: Path) -> None:
    """A file at a `--record PATH` is recorded over only when it is a bench record (of any version)."""
    from stack.user_json import read_json_or_none

    data = read_json_or_none(path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return
    found = f"a JSON object without format {FORMAT!r}" if isinstance(data, dict) else "no JSON object the stack reads"
    raise StackError(f"--record {escaped(str(path))!r}: expected a new path or a bench record to record over; found "
                     f"a file that is not a bench record ({found}), which recording would overwrite. Give another "
                     f".json path or a folder to collect records in (default {DEFAULT_HISTORY}); the file is left "
                     f"as it is")


def write_record(record: Record, destination: Path) -> Path:
    """Write `record` to `destination`: that file when it ends in .json (and is not a folder), else a new file in that
    folder named `<recorded_at>-<bench>-<commit>.json`, so a folder's records list in time order."""
    check_destination(destination)
    destination = Path(destination)
    path = destination if destination.suffix == ".json" and not destination.is_dir() else \
        _new_name(destination, record)
    return write_whole(path, (json.dumps(record.to_json(), indent=1) + "\n").encode(), "bench-record")


def write_whole(path: Path, data: bytes, point: str) -> Path:
    """`data` into `path` whole or not at all (`stack.durable.write_atomic`), with the fail points `<point>-write`
    (half the temporary file written) and `<point>-replace` (all of it, before it replaces `path`) for kill tests."""
    from stack.durable import write_atomic

    def writer(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            handle.write(data[:len(data) // 2])
            handle.flush()
            fail_point(f"{point}-write")
            handle.write(data[len(data) // 2:])
        fail_point(f"{point}-replace")

    return write_atomic(path, writer=writer)


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
    from stack.user_json import read_json

    path = Path(path)
    if not path.is_file():
        raise StackError(missing_file_message("bench record", path, RECORD_AGAIN))  # repr: escaped
    return record_from_json(read_json(path, "a bench record", RECORD_AGAIN), str(path))


def record_from_json(data, source: str) -> Record:
    """Validate the parsed JSON of a record, naming the first field that is wrong (`source`: the file it came from,
    kept as given: the history finds a candidate among its records by it)."""
    where = escaped(source, 1000)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = f"format {escaped(repr(data.get('format')), 80)}" if isinstance(data, dict) else \
            f"a JSON {type(data).__name__}"
        raise StackError(f"{where}: not a bench record: expected an object with format {FORMAT!r}, found {found}. "
                         f"{RECORD_AGAIN}")
    version = _field(data, "version", WHOLE, where)
    if version > VERSION:
        raise StackError(f"{where}: bench record version {version} was written by a newer stack; this one reads "
                         f"version {VERSION}. Compare it with the stack that wrote it.")
    bench = _field(data, "bench", TEXT, where)
    if identifier(bench):
        raise StackError(f"{where}: expected 'bench' to be a bench's name (letters, digits, '_', '.' and '-', not "
                         f"starting with '.': it names the history's trend folder), found {_shown(bench)}. "
                         f"{RECORD_AGAIN}")
    commit = _field(data, "commit", OBJECT, where)
    entries = _field(data, "figures", LIST, where)
    if len(entries) > MAX_FIGURES:
        raise StackError(f"{where}: expected at most {MAX_FIGURES:,} figures (the benches write about a hundred at "
                         f"most), found {len(entries):,}. {RECORD_AGAIN}")
    figures = {}
    for index, entry in enumerate(entries):
        figure = _figure(entry, f"{where}: figures[{index}]")
        if figure.name in figures:
            raise StackError(f"{where}: figures[{index}]: the name {_shown(figure.name)} is used by an earlier figure "
                             f"too; a record names each figure once. {RECORD_AGAIN}")
        figures[figure.name] = figure
    return Record(bench=bench, arguments=_arguments(data, where), commit=_field(commit, "sha", TEXT, where, "commit"),
                  dirty=_field(commit, "dirty", FLAG_OR_NULL, where, "commit", None), machine=_machine(data, where),
                  pipeline=_pipeline(data, where), recorded_at=_field(data, "recorded_at", TEXT, where),
                  exit_code=_field(data, "exit_code", WHOLE, where), figures=figures, source=source,
                  load=_load(data, where))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


OBJECT = ("an object", lambda value: isinstance(value, dict))
LIST = ("a list", lambda value: isinstance(value, list))
TEXT = ("a string", lambda value: isinstance(value, str))
TEXT_OR_NULL = ("a string or null", lambda value: value is None or isinstance(value, str))
TEXTS = ("a list of strings", lambda value: isinstance(value, list) and all(isinstance(x, str) for x in value))
TEXT_VALUES = ("an object of strings", lambda value: isinstance(value, dict)
               and all(isinstance(x, str) for x in value.values()))
WHOLE = ("a whole number", lambda value: isinstance(value, int) and not isinstance(value, bool))
NUMBER_OR_NULL = ("a number or null", lambda value: value is None or _is_number(value))
FLAG = ("true or false", lambda value: isinstance(value, bool))
FLAG_OR_NULL = ("true, false or null", lambda value: value is None or isinstance(value, bool))
SCALAR = ("a string, number, boolean, null or list of strings",
          lambda value: value is None or isinstance(value, (str, int, float)) or TEXTS[1](value))
"""(what a field should be, as an error says it; the check)."""
_REQUIRED = object()


def _field(data: dict, key: str, kind: tuple, where: str, within: str = "", default=_REQUIRED):
    """`data[key]`, which must be `kind` (`default` when absent, if one is given); `within` is the dotted path of
    `data` in the record ("machine.hardware"), for the message."""
    if key not in data and default is not _REQUIRED:
        return default
    value = data.get(key)
    if not kind[1](value):
        name = f"{within}.{key}" if within else key
        raise StackError(f"{where}: expected {escaped(name, 80)!r} to be {kind[0]}, found {_shown(value)}. "
                         f"{RECORD_AGAIN}")
    return value


def _shown(value, limit: int = 80) -> str:
    """A value from a record as an error shows it: JSON, escaped, cut at `limit` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return escaped(text, limit)


def _machine(data: dict, source: str) -> dict:
    """The fingerprint, typed as `stack.benchrecord.machine` writes it: compare reads every key of `hardware`."""
    machine = _field(data, "machine", OBJECT, source)
    hardware = _field(machine, "hardware", OBJECT, source, "machine", {})
    for key, kind in (("cpu", TEXT_OR_NULL), ("isa", TEXTS), ("cores", WHOLE), ("gpu", TEXT_OR_NULL)):
        _field(hardware, key, kind, source, "machine.hardware", None)
    for key in hardware:
        _field(hardware, key, SCALAR, source, "machine.hardware")
    software = _field(machine, "software", OBJECT, source, "machine", {})
    for key in software:
        _field(software, key, TEXT_OR_NULL, source, "machine.software")
    return machine


def _arguments(data: dict, source: str) -> dict:
    arguments = _field(data, "arguments", OBJECT, source)
    for key, kind in (("config", TEXTS), ("overrides", TEXTS), ("environment", TEXT_VALUES)):
        _field(arguments, key, kind, source, "arguments", None)
    return arguments


def _pipeline(data: dict, source: str) -> dict:
    pipeline = _field(data, "pipeline", OBJECT, source)
    for key in ("name", "hash"):
        _field(pipeline, key, TEXT_OR_NULL, source, "pipeline", None)
    return pipeline


def _load(data: dict, source: str) -> dict:
    """The optional load entry: {} when absent (records written before it was kept)."""
    load = data.get("load", {})
    valid = isinstance(load, dict) and all(
        (isinstance(value, list) and all(_is_number(x) for x in value)) if key in ("before", "after")
        else _is_number(value) for key, value in load.items())
    if not valid:
        raise StackError(f"{source}: expected 'load' to hold 'before'/'after' lists of numbers and an 'other_cpu' "
                         f"number, found {_shown(load)}. {RECORD_AGAIN}")
    return {key: [float(x) for x in value] if isinstance(value, list) else float(value) for key, value in load.items()}


def _figure(entry, where: str) -> Figure:
    if not isinstance(entry, dict):
        raise StackError(f"{where}: expected an object, found {_shown(entry)}. {RECORD_AGAIN}")
    samples = _field(entry, "samples", LIST, where)
    if len(samples) > MAX_SAMPLES:
        raise StackError(f"{where}: expected at most {MAX_SAMPLES:,} samples (the benches write at most a few "
                         f"hundred), found {len(samples):,}. {RECORD_AGAIN}")
    floor = _field(entry, "floor", NUMBER_OR_NULL, where, "", None)
    name, unit = _field(entry, "name", TEXT, where), _field(entry, "unit", TEXT, where)
    lower_is_better = _field(entry, "lower_is_better", FLAG, where, "", True)
    bad = next((sample for sample in samples if not _is_number(sample)), None)
    try:
        if bad is not None:
            raise ValueError(f"found {_shown(bad)}")
        return Figure(name, tuple(float(s) for s in samples), unit, lower_is_better,
                      None if floor is None else float(floor))
    except ValueError as exc:
        raise StackError(f"{where}: expected finite numbers for samples and floor: {escaped(str(exc), 160)}. "
                         f"{RECORD_AGAIN}") from None


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
