"""Bench records: written whole, read back the same, refused with what to do when they are not records."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from synthetic_records import make_record, noisy

from stack.benchrecord import FigureLog
from stack.benchrecord.records import DEFAULT_HISTORY, check_destination, load_history, read_record, write_record
from stack.errors import StackError

REPO = Path(__file__).resolve().parents[3]


def test_a_record_round_trips_through_json(tmp_path):
    record = make_record("aaaa0001", {"op, 2 threads": noisy(1.0), "bytes": [4096.0]}, floor=0.25)
    record = record.__class__(**{**record.__dict__, "load": {"before": [0.5, 0.25, 0.125], "after": [1.0, 0.5, 0.25],
                                                                  "other_cpu": 0.25}})
    path = write_record(record, tmp_path / "history")
    assert path.parent == tmp_path / "history" and path.name.endswith("-ops-aaaa0001.json")
    again = read_record(path)
    assert again == record.__class__(**{**record.__dict__, "source": str(path)})
    stored = json.loads(path.read_text())["figures"][0]
    assert stored["samples"] == list(record.figures["op, 2 threads"].samples)
    assert stored["min"] == min(stored["samples"]) and stored["max"] == max(stored["samples"])
    assert write_record(record, tmp_path / "history") != path, "a second record of the same second gets its own file"
    assert write_record(record, tmp_path / "one.json") == tmp_path / "one.json"


def test_the_history_lists_records_oldest_first(tmp_path):
    for minute, commit in ((5, "bbbb0002"), (1, "aaaa0001"), (9, "cccc0003")):
        write_record(make_record(commit, {"op": [1.0]}, minute=minute), tmp_path / f"{commit}.json")
    assert [record.commit for record in load_history(tmp_path)] == ["aaaa0001", "bbbb0002", "cccc0003"]


def test_a_figure_log_refuses_what_a_record_could_not_hold():
    log = FigureLog()
    log.add("op", [1.0, 2.0], "s")
    with pytest.raises(ValueError, match="added twice"):
        log.add("op", [1.0], "s")
    with pytest.raises(ValueError, match="not finite"):
        log.add("nan", [float("nan")], "s")
    with pytest.raises(ValueError, match="no samples"):
        log.add("empty", [], "s")


AGAIN = "stack bench NAME --record"


@pytest.mark.parametrize("text,needles", [
    ('{"format": "stack-bench-record", "version": 1, "bench": "ops"', ("invalid JSON at line 1", AGAIN)),
    ("[1, 2]", ("found a JSON array", AGAIN)),
    ('{"format": "something-else"}', ("found format 'something-else'", AGAIN)),
    ('{"format": "stack-bench-record", "version": 99}', ("version 99 was written by a newer stack", "reads version 1")),
])
def test_a_file_that_is_not_a_record_is_refused_with_what_was_expected(tmp_path, text, needles):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(StackError) as error:
        read_record(path)
    assert all(needle in str(error.value) for needle in needles), str(error.value)


def test_a_record_with_a_wrong_field_names_the_field(tmp_path):
    data = make_record("aaaa0001", {"op": [1.0, 2.0]}).to_json()
    data["figures"][0]["samples"] = [1.0, "fast"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(StackError, match=r"figures\[0\]: expected finite numbers"):
        read_record(path)
    del data["commit"]
    path.write_text(json.dumps(data))
    with pytest.raises(StackError, match="expected 'commit' to be an object, found null"):
        read_record(path)


def test_missing_records_and_empty_histories_say_what_to_do(tmp_path):
    with pytest.raises(StackError, match="bench record .*nope.json' does not exist"):
        read_record(tmp_path / "nope.json")
    with pytest.raises(StackError, match="holds no records"):
        load_history(tmp_path)
    with pytest.raises(StackError, match="bench history folder .* does not exist"):
        load_history(tmp_path / "none")


def test_a_record_path_that_looks_like_an_override_is_refused_before_the_bench_runs(tmp_path):
    with pytest.raises(StackError, match="looks like a key=value override"):
        check_destination(tmp_path / "train.max_epochs=3")


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_the_default_history_folder_is_ignored_by_git():
    probe = str(DEFAULT_HISTORY / "20261124T100000Z-ops-aaaa0001.json")
    result = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO, capture_output=True)
    assert result.returncode == 0, f"{probe} would be committed: add {DEFAULT_HISTORY.parts[0]}/ to .gitignore"


def test_a_history_recorded_out_of_commit_order_reads_in_the_order_the_code_changed(tmp_path):
    """Old commits measured after newer ones (a range measured today, a commit measured again to pool its runs)
    sort by their place in git's history, each commit's records by time; a commit git does not know keeps time
    order, and the line says so."""
    from stack.benchrecord.records import in_commit_order

    repository = tmp_path / "repo"
    repository.mkdir()
    git = ["git", "-C", str(repository), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    commits = []
    for index in range(3):
        (repository / "f").write_text(str(index))
        subprocess.run([*git, "add", "f"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", f"c{index}"], check=True)
        commits.append(subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
    first, second, third = commits
    recorded = [make_record(third, {"op": [1.0]}, minute=1), make_record(first, {"op": [1.0]}, minute=2),
                make_record(second, {"op": [1.0]}, minute=3), make_record(first, {"op": [1.0]}, minute=4)]
    ordered, order = in_commit_order(recorded, repository)
    assert [(r.commit, r.recorded_at[-6:-4]) for r in ordered] == [(first, "02"), (first, "04"), (second, "03"),
                                                                   (third, "01")]
    assert order.startswith("order: by commit")
    stranger = [*recorded, make_record("f" * 40, {"op": [1.0]}, minute=5)]
    kept, order = in_commit_order(stranger, repository)
    assert kept == stranger and order.startswith("order: by time (commits ffffffff are not in the history")
