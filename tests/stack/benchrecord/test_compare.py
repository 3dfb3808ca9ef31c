"""`stack bench compare` through the CLI: verdicts and exit codes on seeded synthetic records, steps and trend
plots over a history, and bad input refused with exit 2."""

import copy
import dataclasses

import pytest
from synthetic_records import MACHINE, make_record, noisy

from stack.benchrecord.records import read_record, write_record
from stack.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def compare(*words) -> int:
    return main(["bench", "compare", *map(str, words)])


def write(folder, record):
    return write_record(record, folder / f"{record.commit}-{record.recorded_at[14:16]}.json")


def test_a_two_times_slower_figure_is_a_regression_and_an_unchanged_one_is_not(tmp_path, capsys):
    base = write(tmp_path, make_record("aaaa0001", {"op": noisy(1.0, seed=1), "copy": noisy(3.0, seed=2)}))
    slower = write(tmp_path, make_record("bbbb0002", {"op": noisy(2.0, seed=3), "copy": noisy(3.0, seed=4)}, minute=1))
    assert compare(base, slower) == 1
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "slower" in rows["op"] and "same" in rows["copy"]
    assert "1 regression: op" in out and "Mann-Whitney U" in out
    same = write(tmp_path, make_record("cccc0003", {"op": noisy(1.0, seed=5), "copy": noisy(3.0, seed=6)}, minute=2))
    assert compare(base, same) == 0
    assert "no regression" in capsys.readouterr().out


def test_figures_from_another_machine_are_listed_not_compared(tmp_path, capsys):
    other = copy.deepcopy(MACHINE)
    other["hardware"].update(cpu="Other CPU", isa=["avx2"])
    base = write(tmp_path, make_record("aaaa0001", {"op": noisy(1.0, seed=1)}))
    elsewhere = write(tmp_path, make_record("bbbb0002", {"op": noisy(5.0, seed=2)}, machine=other, minute=1))
    assert compare(base, elsewhere) == 0, "five times slower on another CPU is no regression of the code"
    out = capsys.readouterr().out
    assert "| op |" in out and "not comparable: different machine |" in out
    assert "cpu: 'Test CPU 9000' vs 'Other CPU'" in out and "only the first has avx512f" in out


def test_the_history_names_the_step_and_draws_each_figure(tmp_path, capsys):
    levels = [1.0] * 5 + [1.6] * 3
    for minute in range(3 * len(levels)):  # three runs a commit: the step test's unit is the run
        commit = minute // 3
        write(tmp_path, make_record(f"commit{commit:02d}", {"op": noisy(levels[commit], seed=minute), "exact": [64.0]},
                                    minute=minute, floor=0.5))
    assert compare("--history", tmp_path) == 0, "the newest record is no slower than the one before it"
    out = capsys.readouterr().out
    assert "candidate: " in out and "commit07" in out and "baseline:  " in out
    assert "- op: slower 1.6" in out and "at commit commit05" in out
    plots = sorted((tmp_path / "trends" / "ops").glob("*.png"))
    assert len(plots) == 2 and all(plot.read_bytes().startswith(PNG) for plot in plots)


def test_a_new_record_slower_than_the_history_fails(tmp_path, capsys):
    history = tmp_path / "history"
    for minute in range(3):
        write_record(make_record(f"commit{minute:02d}", {"op": noisy(1.0, seed=minute)}, minute=minute), history)
    candidate = write(tmp_path, make_record("commit09", {"op": noisy(2.0, seed=9)}, minute=9))
    assert compare(candidate, "--history", history) == 1
    assert "slower" in capsys.readouterr().out


def test_a_first_record_has_nothing_to_compare_against(tmp_path, capsys):
    write(tmp_path, make_record("aaaa0001", {"op": noisy(1.0)}))
    assert compare("--history", tmp_path) == 0
    assert "nothing to compare against yet" in capsys.readouterr().out


def corrupt(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('{"format": "stack-bench-record", "vers')
    return path


@pytest.mark.parametrize("words,needle", [
    (lambda d: [d / "missing.json", d / "good.json"], "missing.json' does not exist"),
    (lambda d: [corrupt(d), d / "good.json"], "invalid JSON at line 1"),
    (lambda d: [d / "good.json"], "found 1 record paths; give two records"),
    (lambda d: [d / "good.json", d / "model.json"], "records are of different benches"),
    (lambda d: [d / "good.json", d / "good.json", "-c", "configs/pipeline.yaml"], "takes no '-c configs/pipeline.yaml'"),
    (lambda d: ["--history", d / "empty"], "does not exist"),
    (lambda d: [d / "good.json", d / "good.json", "--history", d], "takes one record or none, found 2"),
])
def test_bad_input_exits_2_with_what_was_expected(tmp_path, capsys, words, needle):
    write_record(make_record("aaaa0001", {"op": [1.0]}), tmp_path / "good.json")
    write_record(make_record("aaaa0001", {"op": [1.0]}, bench="model"), tmp_path / "model.json")
    assert compare(*words(tmp_path)) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.slow  # the real checkpoint bench: two rounds of saving the tiny network's state (~10 s on 2 cores)
def test_a_real_bench_records_its_figures_with_their_samples(tmp_path, monkeypatch, capsys):
    from stack.train import checkpoint_bench

    monkeypatch.setattr(checkpoint_bench, "ROUNDS", 2)
    # The training loop's part (six Lightning fits, 4-5 min on a loaded 2-core machine) has its own test
    # (tests/train/test_bench.py); here it is one fixed round, so this test times the writer for real and
    # checks what a record keeps of both.
    loop = {"none": [8.0], "async": [8.5], "sync": [8.4]}
    monkeypatch.setattr(checkpoint_bench, "LOOP_ROUNDS", 1)
    monkeypatch.setattr(checkpoint_bench, "measure_loop", lambda pipeline, folder: {
        "seconds": loop, "per_checkpoint": {"async": [0.5], "sync": [0.4]}, "step_ms": 333.0})
    path = tmp_path / "checkpoint.json"
    code = main(["bench", "checkpoint", "-c", "configs/pipeline.yaml", "-c", "configs/presets/tiny.yaml",
                 f"train.out_dir={tmp_path / 'train'}", "--record", str(path)])
    assert f"recorded 9 figures with their samples: {path}" in capsys.readouterr().out
    record = read_record(path)
    assert record.bench == "checkpoint" and record.exit_code == code and record.pipeline["name"] == "tiny"
    assert record.arguments["overrides"] == [f"train.out_dir={tmp_path / 'train'}"]
    assert record.machine["hardware"]["cores"] >= 1 and record.machine["software"]["torch"]
    assert len(record.load["before"]) == 3 and len(record.load["after"]) == 3, "the load it ran under, kept"
    assert 0.0 <= record.other_cpu <= 1.0
    stall = record.figures["synchronous stall"]
    assert len(stall.samples) == 2 and all(s > 0 for s in stall.samples) and stall.floor > 0
    written = record.figures["asynchronous write (background), CPU time"]  # the loop's floor on busy cores
    assert len(written.samples) == 2 and all(s > 0 for s in written.samples)
    assert compare(path, path) == 0


def test_records_taken_under_load_are_set_aside_from_the_steps_and_named_in_a_comparison(tmp_path, capsys):
    """A bench that started while other work loaded the machine moved every sample together: the history's step
    test leaves its record out, and a comparison with it says so."""
    for minute in range(9):
        record = make_record(f"commit{minute // 3:02d}", {"op": noisy(1.0, seed=minute)}, minute=minute)
        write(tmp_path, dataclasses.replace(record, load={"before": [1.5, 0.1, 0.1], "other_cpu": 0.01}))
    slow = make_record("commit03", {"op": noisy(1.5, seed=9)}, minute=9)
    write(tmp_path, dataclasses.replace(slow, load={"before": [0.2, 0.1, 0.1], "other_cpu": 0.45}))
    assert compare("--history", tmp_path) == 1, "the newest record is slower than the one before it"
    out = capsys.readouterr().out
    assert "1 loaded records set aside" in out and "steps over 9 records" in out
    assert "the candidate ran on a loaded machine (other work took 45% of its CPU time while it measured)" in out
    assert "other work 45% of the CPU time" in out and "other work 1% of the CPU time" in out
