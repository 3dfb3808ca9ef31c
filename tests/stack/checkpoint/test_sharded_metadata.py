"""DCP's `.metadata` is a pickle from a file the user may have been given: the reader admits only the plain data
classes DCP metadata needs, and checks a global's name before importing anything (importing runs a module's
top-level code), so a crafted `.metadata` naming `this`, a stager or an fsspec reader runs nothing."""

import pickle
import subprocess
import sys
import warnings

import pytest
import torch

from stack.checkpoint.sharded import read_checkpoint_safely
from stack.errors import StackError


def write_checkpoint(folder) -> dict:
    """A real DCP checkpoint folder as `stack train` writes one (shards, `.metadata`, `meta.pt`)."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": model.state_dict(), "optimizer_0": optimizer.state_dict()},
                 storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    torch.save({"global_step": 1}, folder / "meta.pt")
    return model.state_dict()


def call(module: str, name: str, *args) -> bytes:
    """A pickle (protocol 0) that imports `module.name` and calls it with string or None arguments."""
    return (f"c{module}\n{name}\n(".encode() + b"".join(b"N" if a is None else f"V{a}\n".encode() for a in args)
            + b"tR.")


def test_a_checkpoint_written_by_dcp_loads_through_the_allow_list(tmp_path):
    folder = tmp_path / "step-0000001.ckpt"
    weights = write_checkpoint(folder)
    state = read_checkpoint_safely(folder)
    assert state["global_step"] == 1 and set(state["state_dict"]) == set(weights)
    assert torch.equal(state["state_dict"]["0.weight"], weights["0.weight"])


CRAFTED = {
    "this": (lambda tmp: call("this", "d"), "this"),
    "stager": (lambda tmp: call("torch.distributed.checkpoint.staging", "_ReplicationStager",
                                None, None, None, str(tmp / "made-by-stager")), None),
    "fsspec reader": (lambda tmp: call("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader",
                                       "ftp://127.0.0.1:9/x"), "torch.distributed.checkpoint._fsspec_filesystem"),
    "os.system": (lambda tmp: call("os", "system", f"touch {tmp / 'made-by-system'}"), None),
}

PROBE = """
import sys
from pathlib import Path
from stack.checkpoint.sharded import read_checkpoint_safely
from stack.errors import StackError
before = set(sys.modules)
try:
    read_checkpoint_safely(Path(sys.argv[1]))
except StackError as exc:
    print("REFUSED", str(exc).splitlines()[0])
print("IMPORTED", " ".join(sorted(set(sys.modules) - before)))
"""


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_metadata_is_refused_before_anything_is_imported_or_called(tmp_path, case):
    folder = tmp_path / "step-0000001.ckpt"
    write_checkpoint(folder)
    payload, module = CRAFTED[case]
    (folder / ".metadata").write_bytes(payload(tmp_path))
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in done.stdout and "is not a readable training checkpoint" in done.stdout, done.stdout + done.stderr
    assert "is not part of a checkpoint's metadata" in done.stdout
    assert "Beautiful is better than ugly" not in done.stdout
    imported = done.stdout.split("IMPORTED", 1)[1].split()
    assert module is None or module not in imported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000001.ckpt"]


def test_a_shard_named_outside_the_checkpoint_folder_is_refused(tmp_path):
    folder = tmp_path / "step-0000001.ckpt"
    write_checkpoint(folder)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(StackError, match=r"not a file name inside the checkpoint folder"):
        read_checkpoint_safely(folder)
