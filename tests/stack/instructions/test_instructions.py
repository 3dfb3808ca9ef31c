"""The instruction-count regression check: callgrind dumps read right, the verdict's rule on hand-made profiles,
bad input refused, and (slow, under valgrind) a kernel made to do more work fails naming its function."""

import copy
import shutil

import pytest

from stack.cli import main
from stack.errors import StackError
from stack.instructions import baseline as bl
from stack.instructions import callgrind
from stack.instructions.callgrind import EVENTS, Profile, read_dump

KERNEL = "stack::forward_tiles_float(float*) [clone .arch_x86_64_v3] [_C.cpython-311-x86_64-linux-gnu.so]"
FREE = "_int_free [libc.so.6]"
PYTHON = "_PyEval_EvalFrameDefault [libpython3.11.so.1.0]"
VERSIONS = {"python": "3.11.7", "torch": "2.14.1", "numpy": "2.4.6", "compiler": "GCC 12.2.0", "valgrind": "3.19.0"}
LEVEL = {"level": "avx2", "torch_capability": "AVX2", "avx512": False, "avx2": True}

DUMP = """version: 1
creator: callgrind-3.19.0
pid: 1
cmd: python -m stack.instructions.workloads
part: 2

desc: I1 cache: 32768 B, 64 B, 8-way associative
desc: Trigger: Client Request: bev_pool.forward

positions: line
events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw

ob=/work/stack/_C.cpython-311-x86_64-linux-gnu.so
fl=/work/csrc/bev_pool_cpu.cpp
fn=stack::forward_tiles_float(float*) [clone .arch_x86_64_v3]
200 1000 400 100 0 30 5 0 2 1
201 500 100 50 0 10
cob=/lib/x86_64-linux-gnu/libc.so.6
cfl=???
cfn=_int_free
calls=3 0
200 900 300 0 0 40 0 0 9 0
ob=/lib/x86_64-linux-gnu/libc.so.6
fl=???
fn=_int_free
0 900 300 0 0 40 0 0 9 0

totals: 2400
"""


def profile(kernel: int = 2_000_000, free: int = 500_000, python: int = 7_500_000, misses: int = 50_000,
            ll_misses: int = 0) -> Profile:
    """One stage of 10 M instructions: a project kernel, libc's free and the interpreter."""
    def costs(ir, d1, ll=0):
        return [ir, d1, 0, ll, 0]
    return Profile(dict(LEVEL), {"bev_pool.forward": {KERNEL: costs(kernel, misses, ll_misses), FREE: costs(free, 0),
                                                      PYTHON: costs(python, 0)}})


def baseline_of(p: Profile) -> dict:
    return bl.make_baseline(p, {"cpu": "AMD EPYC"}, "abc", dict(VERSIONS))


def test_a_dump_gives_its_stage_and_each_functions_own_costs_without_its_callees():
    stage, functions = read_dump(DUMP)
    assert stage == "bev_pool.forward"
    kernel = "stack::forward_tiles_float(float*) [clone .arch_x86_64_v3] [_C.cpython-311-x86_64-linux-gnu.so]"
    # Ir, D1mr, D1mw, DLmr, DLmw: the two cost lines of the kernel, not the call's inclusive line
    assert functions[kernel] == [1500, 40, 5, 2, 1]
    assert functions[FREE] == [900, 40, 0, 9, 0]
    assert EVENTS == ("Ir", "D1mr", "D1mw", "DLmr", "DLmw")


def test_the_exit_dump_has_no_stage():
    stage, _ = read_dump(DUMP.replace("desc: Trigger: Client Request: bev_pool.forward", "desc: Trigger: Program termination"))
    assert stage is None


def test_unchanged_counts_pass_and_a_baseline_ten_percent_lower_fails_naming_the_function():
    p = profile()
    assert bl.judge(p, baseline_of(p), VERSIONS).regressions == []
    lower = baseline_of(p)
    stage = lower["stages"]["bev_pool.forward"]
    stage["instructions"] = int(stage["instructions"] / 1.10)
    stage["functions"][KERNEL] = int(stage["functions"][KERNEL] / 1.10)
    found = bl.judge(p, lower, VERSIONS).regressions
    assert any(line.startswith("bev_pool.forward: instructions") and "+10.0%" in line and "grew most: stack::forward"
               in line for line in found), found
    assert any(line.startswith(f"bev_pool.forward: function {KERNEL}") for line in found), found


def test_a_kernel_that_grows_inside_a_larger_stage_fails_and_a_library_function_does_not():
    base = baseline_of(profile())
    kernel_slower = bl.judge(profile(kernel=2_100_000), base, VERSIONS).regressions  # stage +1%, kernel +5%
    assert len(kernel_slower) == 1 and f"function {KERNEL}" in kernel_slower[0] and "+5.0%" in kernel_slower[0]
    assert bl.judge(profile(free=550_000), base, VERSIONS).regressions == []  # libc +10%, stage +0.5%
    assert bl.judge(profile(kernel=2_040_000), base, VERSIONS).regressions == []  # kernel +2%: under the limit


def test_on_another_kind_of_cpu_only_the_projects_kernels_are_judged():
    """Library kernels (OpenBLAS, MKL, oneDNN) are chosen by the CPU's identity: on a CPU other than the
    baseline's, a stage total that grew is a note; a kernel function of stack._C that grew still fails."""
    base = baseline_of(profile())
    assert bl.same_cpu({"cpu": "AMD EPYC"}, base) and not bl.same_cpu({"cpu": "Intel Xeon"}, base)
    library = bl.judge(profile(python=8_500_000), base, VERSIONS, totals_judged=False)  # stage +10%, in Python
    assert library.regressions == [] and any("instructions" in note and "+10.0%" in note for note in library.notes)
    assert bl.judge(profile(python=8_500_000), base, VERSIONS).regressions  # on the baseline's CPU: a failure
    kernel = bl.judge(profile(kernel=2_400_000), base, VERSIONS, totals_judged=False).regressions
    assert len(kernel) == 1 and f"function {KERNEL}" in kernel[0]


def test_misses_have_their_own_limit_and_small_counts_are_not_judged():
    base = baseline_of(profile())
    assert bl.judge(profile(misses=57_000), base, VERSIONS).regressions == []  # +14%
    found = bl.judge(profile(misses=61_000), base, VERSIONS).regressions  # +22%
    assert len(found) == 1 and found[0].startswith("bev_pool.forward: D1 misses 50,000 -> 61,000 (+22.0%, limit +20%)")
    few = baseline_of(profile(misses=5_000))
    assert bl.judge(profile(misses=9_000), few, VERSIONS).regressions == []


def test_last_level_misses_fail_only_past_what_another_working_folder_moves_them():
    """LL misses moved +21.8% between two clones of one commit on one machine (where allocations land): that
    passes; a layout that stops fitting the cache (+60%) fails."""
    base = baseline_of(profile(ll_misses=40_000))
    assert bl.judge(profile(ll_misses=48_800), base, VERSIONS).regressions == []  # +22%
    found = bl.judge(profile(ll_misses=64_000), base, VERSIONS).regressions  # +60%
    assert len(found) == 1 and found[0].startswith("bev_pool.forward: LL misses 40,000 -> 64,000 (+60.0%, limit +50%)")


def test_a_software_difference_is_named_and_still_judged():
    base = baseline_of(profile())
    newer = {**VERSIONS, "torch": "2.15.0"}
    same_counts = bl.judge(profile(), base, newer)
    assert same_counts.regressions == [] and any("torch '2.14.1' then, '2.15.0' now" in n for n in same_counts.notes)
    grown = bl.judge(profile(python=9_000_000), base, newer).regressions
    assert grown[0].startswith("bev_pool.forward: instructions") and "record the baseline again" in grown[-1]


def test_new_and_vanished_stages_are_said_not_failed():
    p = profile()
    base = copy.deepcopy(baseline_of(p))
    base["stages"]["render.shade"] = base["stages"].pop("bev_pool.forward")
    verdict = bl.judge(p, base, VERSIONS)
    assert verdict.regressions == []
    assert any("bev_pool.forward: new stage" in n for n in verdict.notes)
    assert any("render.shade: in the baseline, not measured" in n for n in verdict.notes)


def test_without_valgrind_the_check_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(StackError, match="apt-get install valgrind"):
        callgrind.require_tools()


def test_check_and_update_baseline_belong_to_the_instructions_bench(capsys):
    assert main(["bench", "ops", "--check"]) == 2
    assert "belong to `stack bench instructions`" in capsys.readouterr().err
    assert main(["bench", "instructions", "--check", "--update-baseline"]) == 2
    assert "give one" in capsys.readouterr().err


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """`stack bench instructions` on a hand-made profile, with baselines in tmp_path/baselines."""
    from stack.instructions import bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bl, "BASELINE_DIR", tmp_path / "baselines")
    monkeypatch.setattr(bl, "software", lambda: dict(VERSIONS))
    current = {"profile": profile()}
    monkeypatch.setattr(bench, "run_workloads", lambda: current["profile"])
    return current


def test_the_command_records_a_baseline_passes_on_it_and_fails_on_growth(measured, tmp_path, capsys):
    assert main(["bench", "instructions", "--update-baseline"]) == 0
    assert (tmp_path / "baselines" / "avx2.json").is_file()
    assert main(["bench", "instructions", "--check"]) == 0
    assert "pass: no stage's instructions" in capsys.readouterr().out
    measured["profile"] = profile(kernel=2_400_000)
    assert main(["bench", "instructions", "--check"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "grew most: stack::forward_tiles_float" in out
    assert main(["bench", "instructions"]) == 0  # without --check: the same report, exit 0


def test_a_level_without_a_baseline_fails_the_check_and_leaves_its_counts_to_commit(measured, tmp_path, capsys):
    measured["profile"].level["level"] = "avx512"
    assert main(["bench", "instructions", "--check"]) == 1
    out = capsys.readouterr().out
    assert "no baseline for level avx512" in out and "measured, not judged" in out
    assert bl.read_baseline(tmp_path / "runs" / "instructions" / "avx512.json")["level"] == "avx512"


@pytest.mark.slow
def test_a_kernel_doing_twice_the_work_fails_the_check_naming_it():
    """The bev_pool kernels on a context twice as wide (the same code, twice the channels per point) against the
    stored baseline: forward and backward fail on their totals, naming the function that grew most, and on their
    kernel functions (forward_tiles_float +9%: its per-point work dominates; backward_sample_float +25%); the
    geometry kernel, whose input did not change, passes."""
    if shutil.which("valgrind") is None:
        pytest.skip("needs valgrind (`make install` installs it: apt-get install valgrind)")
    slowed = callgrind.run_workloads(scale=2, workloads="bev_pool")
    base = bl.read_baseline(bl.baseline_path(slowed.level["level"]))
    if base is None:
        pytest.skip(f"no baseline for level {slowed.level['level']} in {bl.BASELINE_DIR}")
    from stack.benchrecord.machine import hardware

    totals_judged = bl.same_cpu(hardware(), base)  # elsewhere only the kernel functions are judged
    found = bl.judge(slowed, base, bl.software(), totals_judged=totals_judged).regressions
    assert any(line.startswith("bev_pool.forward: function stack::") and "forward_tiles_float" in line
               for line in found), found
    assert any(line.startswith("bev_pool.backward: function stack::") and "backward_sample_float" in line
               for line in found), found
    assert not any(line.startswith("bev_pool.geometry") for line in found), found
    if totals_judged:
        assert any(line.startswith("bev_pool.forward: instructions") and "grew most: void stack::" in line
                   and "transpose" in line for line in found), found
        assert any(line.startswith("bev_pool.backward: instructions") and "grew most: stack::" in line
                   and "backward_sample_float" in line for line in found), found
