"""Importing `stack` and running `stack config` load no framework and touch no GPU."""

import subprocess
import sys

HEAVY = ("torch", "lightning", "pytorch_lightning", "nvidia.dali", "onnx", "onnxruntime", "timm", "tensorrt")

PROBE = f"""
import sys
import stack, stack.pipeline, stack.config, stack.cli
from stack.cli import main
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["config", "-c", "configs/pipeline.yaml"]) == 0
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_import_and_config_load_nothing_heavy():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                            cwd=__file__.rsplit("/tests/", 1)[0])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"heavy modules imported: {result.stdout.strip()}"
