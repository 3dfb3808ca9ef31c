"""Records are files anyone who can write to the history folder may have crafted or cut short: each is refused on
read with what was expected and what to do (exit 2), names from them are printed escaped, `--record` never
overwrites a file that is not a record, and a kill while a record or a trend plot is written leaves the earlier
file whole."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_records import make_record, noisy

from stack.benchrecord import records
from stack.benchrecord.records import check_destination, read_record, write_record
from stack.cli import main
from stack.errors import StackError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"


def compare(*words) -> int:
    return main(["bench", "compare", *map(str, words)])


def crafted(path: Path, edit) -> Path:
    """A record of the synthetic bench at `path`, its JSON changed by `edit(data)` (which may return new text)."""
    data = json.loads(json.dumps(make_record("aaaa0001", {"op": noisy(1.0)}).to_json()))  # a copy: MACHINE is shared
    text = edit(data)
    path.write_text(text if isinstance(text, str) else json.dumps(data))
    return path


def test_a_bench_name_that_would_leave_the_history_folder_is_refused_and_nothing_is_written_outside(tmp_path, capsys):
    history = tmp_path / "history"
    history.mkdir()
    write_record(make_record("aaaa0001", {"op": noisy(1.0, seed=1)}), history / "a.json")
    for name, minute in (("b.json", 1), ("c.json", 2)):
        crafted(history / name, lambda data: data.update(bench="../../escaped",
                                                         recorded_at=f"2026-11-24T11:0{minute}:00Z"))
    assert compare("--history", history) == 2
    err = capsys.readouterr().err
    assert "expected 'bench' to be a bench's name" in err and "escaped" in err and "Traceback" not in err, err
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.rglob("*.png"))


@pytest.mark.parametrize("text,needle", [
    ('{"format": "stack-bench-record", "deep": ' + "[" * 5000 + "]" * 5000 + "}", "nested more than 64 levels deep"),
    ('{"format": "stack-bench-record", "version": 1e999}', "found the number 1e999"),
    ('{"format": "stack-bench-record", "version": 1' + "0" * 5000 + "}", "(5001 digits)"),
])
def test_deep_or_huge_number_json_is_one_line_not_a_traceback(tmp_path, capsys, text, needle):
    path = tmp_path / "record.json"
    path.write_text(text)
    assert compare(path, path) == 2
    err = capsys.readouterr().err
    assert needle in err and "stack bench NAME --record" in err and "Traceback" not in err, err


def test_a_figure_with_more_samples_than_a_bench_writes_is_refused_on_read(tmp_path):
    path = crafted(tmp_path / "huge.json", lambda data: data["figures"][0].update(samples=[1.0] * 1_000_000))
    with pytest.raises(StackError) as raised:
        read_record(path)
    message = str(raised.value)
    assert "figures[0]" in message and f"at most {records.MAX_SAMPLES:,} samples" in message and "1,000,000" in message
    assert len(message) < 600, "the message shows the count, not the samples"


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["machine"].update(hardware="a string"), "expected 'machine.hardware' to be an object"),
    (lambda d: d["machine"]["hardware"].update(isa="avx2"), "expected 'machine.hardware.isa' to be a list of strings"),
    (lambda d: d["machine"]["hardware"].update(cores="two"), "expected 'machine.hardware.cores' to be a whole number"),
    (lambda d: d["machine"].update(software=[1]), "expected 'machine.software' to be an object"),
    (lambda d: d["arguments"].update(overrides="a=1"), "expected 'arguments.overrides' to be a list of strings"),
    (lambda d: d["pipeline"].update(name=3), "expected 'pipeline.name' to be a string"),
    (lambda d: d["commit"].update(dirty="no"), "expected 'commit.dirty' to be true, false or null"),
    (lambda d: d["figures"][0].update(samples=[1.0, "2.0"]), "expected finite numbers"),
    (lambda d: d["figures"][0].update(lower_is_better="false"), "expected 'lower_is_better' to be true or false"),
    (lambda d: d.update(load={"other_cpu": "x" * 5000}), "expected 'load' to hold"),
])
def test_a_field_of_the_wrong_type_is_named_and_compare_does_not_crash(tmp_path, capsys, edit, needle):
    good = write_record(make_record("aaaa0001", {"op": noisy(1.0)}), tmp_path / "good.json")
    bad = crafted(tmp_path / "bad.json", edit)
    assert compare(good, bad) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err) < 1000, err


def test_names_from_a_record_are_printed_escaped(tmp_path, capsys):
    hostile = "\x1b[2J\x1b]0;owned\x07"
    record = make_record("aaaa0001" + hostile, {"op" + hostile: noisy(1.0, seed=1)}, unit="s" + hostile)
    machine = json.loads(json.dumps(record.machine))
    machine["hardware"]["cpu"] += hostile
    machine["software"]["torch"] += hostile

    def edit(data):
        data.update(machine=machine, pipeline={"name": "tiny" + hostile, "hash": "0" * 16 + hostile},
                    recorded_at="2026-11-24T10:00:00Z" + hostile)
        data["arguments"]["overrides"] = ["a=" + hostile]

    first = tmp_path / "history" / "a.json"
    first.parent.mkdir()
    write_record(record, first)
    second = crafted(tmp_path / "history" / "b.json", edit)
    data = json.loads(second.read_text())
    data["figures"] = json.loads(first.read_text())["figures"]
    data["commit"]["sha"] = "bbbb0002" + hostile
    second.write_text(json.dumps(data))
    assert compare(first, second) in (0, 1)
    assert compare("--history", first.parent) in (0, 1)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out, out


@pytest.fixture
def quick_bench(monkeypatch):
    """`stack bench ops` replaced by `synthetic_records.quick_bench`; the list of the benches it ran."""
    from stack.commands.bench import BENCHMARKS

    import synthetic_records

    ran = []
    monkeypatch.setitem(BENCHMARKS, "ops", "synthetic_records:quick_bench")
    monkeypatch.setattr(synthetic_records, "RAN", ran)
    return ran


def test_record_refuses_to_overwrite_a_json_file_that_is_not_a_record_before_the_bench_runs(tmp_path, capsys,
                                                                                           quick_bench):
    mine = tmp_path / "results.json"
    mine.write_text('{"my": "numbers"}\n')
    assert main(["bench", "ops", "--record", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "is not a bench record" in err and "would overwrite" in err and "Traceback" not in err, err
    assert mine.read_text() == '{"my": "numbers"}\n' and not quick_bench, "refused before the bench ran"
    mine.write_bytes(b"\xff\xfe binary")
    with pytest.raises(StackError, match="is not a bench record"):
        check_destination(mine)
    record = write_record(make_record("aaaa0001", {"op": [1.0]}), tmp_path / "record.json")
    check_destination(record)  # a record may be recorded over
    check_destination(tmp_path / "absent.json")


def test_a_folder_named_like_a_json_file_collects_records(tmp_path, capsys, quick_bench):
    folder = tmp_path / "history.json"
    folder.mkdir()
    assert main(["bench", "ops", "--record", str(folder)]) == 0
    written, = folder.glob("*.json")
    assert read_record(written).bench == "ops" and quick_bench == ["ops"]
    assert f"recorded 1 figures with their samples: {written}" in capsys.readouterr().out


def test_a_record_folder_that_cannot_be_made_is_refused_before_the_bench_runs(tmp_path, capsys, quick_bench):
    (tmp_path / "file").write_text("mine")
    assert main(["bench", "ops", "--record", str(tmp_path / "file" / "sub.json")]) == 2
    assert "cannot create the folder" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine" and not quick_bench


WRITE_RECORD = """
import sys
sys.path.insert(0, {here!r})
from pathlib import Path
from synthetic_records import make_record, noisy
from stack.benchrecord.records import write_record
write_record(make_record("bbbb0002", {{"op": noisy(2.0, seed=2, n=2000)}}, minute=1), Path({path!r}))
"""


def killed(code: str, point: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STACK_FAIL_POINT": point, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("point", ["bench-record-write", "bench-record-replace"])
def test_a_kill_while_a_record_is_written_leaves_the_earlier_record_whole(tmp_path, capsys, point):
    earlier = make_record("aaaa0001", {"op": noisy(1.0, seed=1)})
    path = write_record(earlier, tmp_path / "record.json")
    before = path.read_bytes()
    run = killed(WRITE_RECORD.format(here=str(HERE), path=str(path)), point)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert path.read_bytes() == before
    assert compare(path, path) == 0 and compare("--history", tmp_path) == 0
    folder = tmp_path / "folder"
    folder.mkdir()
    run = killed(WRITE_RECORD.format(here=str(HERE), path=str(folder)), point)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert not list(folder.glob("*.json")), "no record, rather than a torn one"


COMPARE_HISTORY = """
from stack.cli import main
main(["bench", "compare", "--history", {folder!r}])
"""


@pytest.mark.parametrize("point", ["trend-write", "trend-replace"])
def test_a_kill_while_a_trend_plot_is_written_leaves_the_earlier_plot_whole(tmp_path, capsys, point):
    for minute in range(3):
        write_record(make_record(f"commit{minute:02d}", {"op": noisy(1.0, seed=minute)}, minute=minute), tmp_path)
    assert compare("--history", tmp_path) == 0
    plot, = (tmp_path / "trends" / "ops").glob("*.png")
    before = plot.read_bytes()
    assert before.startswith(PNG) and before.endswith(PNG_END)
    write_record(make_record("commit03", {"op": noisy(1.0, seed=3)}, minute=3), tmp_path)
    run = killed(COMPARE_HISTORY.format(folder=str(tmp_path)), point)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert plot.read_bytes() == before and [p.name for p in plot.parent.glob("*.png")] == [plot.name]
    assert compare("--history", tmp_path) == 0
    after = plot.read_bytes()
    assert after != before and after.startswith(PNG) and after.endswith(PNG_END)


def test_trend_plots_that_cannot_be_written_are_named_and_the_verdicts_stand(tmp_path, capsys):
    for minute in range(2):
        write_record(make_record(f"commit{minute:02d}", {"op": noisy(1.0, seed=minute)}, minute=minute), tmp_path)
    write_record(make_record("commit02", {"op": noisy(2.0, seed=2)}, minute=2), tmp_path)
    (tmp_path / "trends").write_text("mine")
    assert compare("--history", tmp_path) == 1, "the newest record is slower: the exit code says so without plots"
    out = capsys.readouterr().out
    assert "trend plots: 0 PNGs in" in out and "could not write the rest (Not a directory" in out, out
    assert (tmp_path / "trends").read_text() == "mine"


def test_a_bench_that_times_more_runs_than_a_record_holds_keeps_evenly_spaced_ones():
    """A microsecond op timed for half a second on a fast CPU: the record stays readable by the stack itself."""
    from stack.benchrecord.figures import MAX_SAMPLES, FigureLog

    log = FigureLog()
    log.add("op", range(3 * MAX_SAMPLES), "ms")
    kept = log.figures[0].samples
    assert len(kept) == MAX_SAMPLES and kept[0] == 0.0 and kept[1] == 3.0 and kept[-1] == 3.0 * (MAX_SAMPLES - 1)
