"""Deploy test fixtures; the stand-in network lives in deploy_fixture_net.py (importable by tests)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib does not put test folders on sys.path

from deploy_fixture_net import example_inputs, make_net  # noqa: E402


@pytest.fixture(scope="session")
def fixture_onnx(tmp_path_factory):
    """(path of the fp32 ONNX of the plain fixture net, the net)."""
    from stack.deploy.export import export_onnx

    net = make_net()
    path = tmp_path_factory.mktemp("fixture") / "net.onnx"
    export_onnx(net, example_inputs(), ["segmentation", "speed"], path, opset=17, metadata={"pipeline_hash": "x"})
    return path, net
