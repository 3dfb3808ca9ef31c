"""Turns hardware markers (`gpu`, `trt`) into skips that say why they cannot run here, runs the tests as another
CPU would (`--emulate-cpu`), and compares results with reference data stored in `tests/assets/`
(`arrays_reference`)."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from stack.cpu_emulation import EMULATED_CPUS, cpu_kernels, emulated_cpu_env, emulation_problems

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `helpers`: --import-mode=importlib does not add it

from helpers import MARKER_SKIP_REASONS  # noqa: E402

ASSETS = Path(__file__).resolve().parent / "assets"


def pytest_addoption(parser):
    parser.addoption("--emulate-cpu", choices=list(EMULATED_CPUS), default=None,
                     help="run the tests as on an AVX2-only CPU (avx2) or an SSE4.2 one (x86-64-v2): pytest starts "
                          "again with numpy's SIMD dispatch, PyTorch's kernels, oneDNN, MKL and OpenBLAS limited to "
                          "that CPU's instructions (stack.cpu_emulation.EMULATED_CPUS)")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """--emulate-cpu: numpy and oneDNN read their limits once, at start-up, so pytest runs again in a process
    started with them; that process checks that they took (numpy dispatch, PyTorch's capability) or stops."""
    level = config.getoption("emulate_cpu")
    if level is None:
        return None
    if os.environ.get("STACK_EMULATED_CPU") == level:
        problems = emulation_problems(level)
        if problems:
            raise pytest.UsageError(f"--emulate-cpu={level} did not take: " + "; ".join(problems))
        return None
    env = emulated_cpu_env(level)
    print(f"--emulate-cpu={level}: running pytest again with " + " ".join(f"{k}={v!r}" for k, v in env.items()),
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.chdir(config.invocation_params.dir)
    os.execve(sys.executable, [sys.executable, "-m", "pytest", *config.invocation_params.args], {**os.environ, **env})


INDUCTOR_CACHE = pytest.StashKey[str]()
OWN_CACHE = "STACK_TESTS_INDUCTOR_CACHE"
"""The cache this test run made (its workers make theirs inside it), as opposed to one the user exported."""
SERIAL = "serial"
"""The marker of a test that must run alone (`@pytest.mark.serial`): only such tests, not their files, so that the
rest of a file (its logic, its refusals) runs in the parallel part."""
SERIAL_REASON = ("judges measured time or shares the one-node SLURM cluster: `make test` runs it alone, after the "
                 "parallel run (`pytest -n`), so another test's load cannot decide it")


def pytest_configure(config):
    """Each test run compiles into a TorchInductor cache of its own (`torch.compile` tests and their children).

    Inductor's default cache, /tmp/torchinductor_<user>, is shared by every process of the user: two test runs
    at once (a developer's and a CI job's, or two worktrees) write and load the same generated kernels, and one
    run once died with SIGABRT loading a kernel the other was writing. A cache per run costs only the first
    compile of each graph, which a fresh CI machine pays anyway. An explicit TORCHINDUCTOR_CACHE_DIR is kept."""
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get(OWN_CACHE) == os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        # a worker of `pytest -n`: one cache each, inside the run's (removed with it), for the same reason
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"{worker}-", dir=os.environ[OWN_CACHE])
    elif "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        made = tempfile.mkdtemp(prefix="stack-tests-inductor-")
        config.stash[INDUCTOR_CACHE] = os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[OWN_CACHE] = made
    config.addinivalue_line("markers", f"{SERIAL}: {SERIAL_REASON}")


def pytest_unconfigure(config):
    made = config.stash.get(INDUCTOR_CACHE, None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def pytest_report_header(config):
    return f"CPU kernels: {cpu_kernels()}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, reason_for in MARKER_SKIP_REASONS.items():
            if marker in item.keywords:
                reason = reason_for()
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))


def _mismatch(key: str, found: np.ndarray, expected: np.ndarray, atol: float) -> str | None:
    """What differs between one found array and its reference (None: they agree)."""
    if found.shape != expected.shape:
        return f"{key}: shape {found.shape}, expected {expected.shape}"
    if found.dtype.kind != expected.dtype.kind:
        return f"{key}: dtype {found.dtype}, expected {expected.dtype}"
    if expected.dtype.kind != "f":
        wrong = found != expected
        if not wrong.any():
            return None
        first = tuple(int(i) for i in np.argwhere(wrong)[0]) if wrong.ndim else ()
        return (f"{key}: {int(wrong.sum())} of {wrong.size} values differ (compared exactly); first at {first}: "
                f"{found[first]!r}, expected {expected[first]!r}")
    same_special = (found == expected) | (np.isnan(found) & np.isnan(expected))  # equal infinities, both NaN
    with np.errstate(invalid="ignore"):  # inf - inf where only one side is special: counted as infinitely off
        error = np.where(same_special, 0.0, np.abs(found.astype(np.float64) - expected))
    error = np.nan_to_num(error, nan=np.inf)
    if not error.size or error.max() <= atol:
        return None
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(error), error.shape))
    return (f"{key}: {int((error > atol).sum())} of {error.size} values off by more than {atol:g}; worst at {worst}: "
            f"{found[worst]!r}, expected {expected[worst]!r}")


def check_against_reference(found: dict, name: str, atol: float) -> None:
    """Compare named arrays with the plain-data reference `tests/assets/<name>` (an .npz of arrays, no pickles).

    Integer, boolean and string arrays must be equal exactly; float arrays within `atol` (infinities and NaN
    where the reference has them). Every difference is listed. With `STACK_UPDATE_GOLDEN=1` the reference is
    rewritten from `found` and the test is skipped: do that only when the output changed on purpose, and say
    why in the commit.
    """
    path = ASSETS / name
    found = {key: np.asarray(value) for key, value in found.items()}
    if os.environ.get("STACK_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **found)
        pytest.skip(f"STACK_UPDATE_GOLDEN is set: wrote {path.relative_to(ASSETS.parent.parent)}")
    with np.load(path, allow_pickle=False) as stored:
        expected = {key: stored[key] for key in stored.files}
    problems = [f"{key}: missing (the reference has it)" for key in expected.keys() - found.keys()]
    problems += [f"{key}: not in the reference" for key in found.keys() - expected.keys()]
    problems += [problem for key in sorted(expected.keys() & found.keys())
                 if (problem := _mismatch(key, found[key], expected[key], atol)) is not None]
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        pytest.fail(f"{len(problems)} of {len(expected)} arrays differ from tests/assets/{name}:\n  {shown}\n"
                    "If this change is intended, rewrite the reference with STACK_UPDATE_GOLDEN=1 and say why in "
                    "the commit.", pytrace=False)


@pytest.fixture(name="arrays_reference", scope="session")
def arrays_reference_fixture():
    """check_against_reference(found: dict[str, array], name: str, atol: float): see that function."""
    return check_against_reference
