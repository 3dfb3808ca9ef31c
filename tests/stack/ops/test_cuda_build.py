"""The CUDA kernels carry a cubin for each architecture setup.py names (CUDA_ARCHS; 8.0 covers 8.x), PTX for the
newest."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _cuobjdump():
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() else shutil.which("cuobjdump")


def test_every_named_architecture_has_a_cubin_and_the_newest_has_ptx():
    import importlib.util

    import torch  # noqa: F401  (loads libc10 and the rest, which the extension links against)

    spec = importlib.util.find_spec("stack._C")
    if spec is None or spec.origin is None:
        pytest.skip("stack._C was not built (no C++ compiler at install time)")
    library = Path(spec.origin)
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (it ships inside triton's nvidia backend)")
    elves = subprocess.run([tool, "--list-elf", str(library)], capture_output=True, text=True)
    if "sm_" not in elves.stdout:
        pytest.skip(f"{library.name} was built without CUDA kernels (no nvcc at install time)")
    archs = re.search(r'CUDA_ARCHS = "([^"]+)"', (REPO / "setup.py").read_text()).group(1)
    expected = {a.replace("+PTX", "").replace(".", "") for a in archs.split(";")}
    built = set(re.findall(r"\.sm_(\d+)\.cubin", elves.stdout))
    assert built == expected, f"cubins for sm_{sorted(built)}, setup.py names {sorted(expected)}"
    ptx = subprocess.run([tool, "--list-ptx", str(library)], capture_output=True, text=True).stdout
    newest = max(expected, key=int)
    assert f"sm_{newest}.ptx" in ptx, ptx
