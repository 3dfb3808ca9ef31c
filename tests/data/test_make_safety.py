"""`stack data make` never destroys a dataset before its successor is complete, and deletes only what a manifest lists."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stack.errors import StackError

REPO = Path(__file__).resolve().parents[2]
SMALL = ["data.rig.image_width=64", "data.rig.image_height=32", "data.world.frames_per_scene=2",
         "data.world.agents_per_scene=4", "data.world.workers=1", "data.world.render_device=cpu",
         "data.samples_per_shard=1", "data.world.val_fraction=0.34", "data.batch_size=1", "data.num_workers=0"]


def make(root, *overrides, fail_at=None, file_limit=None, cwd=REPO):
    """`stack data make` as its own process (a kill point SIGKILLs it there; `file_limit` bytes: `ulimit -f`; `cwd`
    inside data.root: the swap renames in place), rc and output."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("STACK_FAIL_POINT", None)
    if fail_at:
        env["STACK_FAIL_POINT"] = fail_at
    limit = (lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_FSIZE, (file_limit, file_limit))) \
        if file_limit else None
    result = subprocess.run([sys.executable, "-m", "stack", "data", "make", *SMALL, f"data.root={root}", *overrides],
                            cwd=cwd, capture_output=True, text=True, env=env, timeout=300, preexec_fn=limit)
    return result.returncode, result.stdout + result.stderr


def snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def loads(root) -> int:
    """Samples the torch loader yields from the dataset at `root` (both splits)."""
    from stack.config import load_pipeline
    from stack.data import build_loader

    pipeline = load_pipeline(overrides=[*SMALL, f"data.root={root}"])
    return sum(batch.images.shape[0] for split in ("train", "val")
               for batch in build_loader(pipeline, split, 0, 1, shuffle=False, augment=False))


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """A complete 3-scene dataset (6 samples) with a user's own files beside the shards; its bytes."""
    root = tmp_path_factory.mktemp("previous")
    rc, output = make(root, "data.world.scenes=3")
    assert rc == 0, output
    (root / "train" / "frames-foo.tar").write_bytes(b"the user's own shard")
    (root / "README").write_text("mine")
    return root, snapshot(root)


def copy_of(previous, tmp_path) -> Path:
    root, files = previous
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    return tmp_path


@pytest.mark.parametrize("point", ["data-render:2", "shard-write:9", "data-before-swap", "data-swap"])
def test_a_kill_before_the_swap_leaves_the_previous_dataset_intact(previous, tmp_path, point):
    root = copy_of(previous, tmp_path)
    rc, output = make(root, "data.world.scenes=4", "data.world.seed=5", fail_at=point)
    assert rc == -9, output  # SIGKILLed at the point
    kept = {name: data for name, data in snapshot(root).items() if not name.startswith(".staging")}
    assert kept == previous[1]
    assert loads(root) == 6
    rc, output = make(root, "data.world.scenes=4", "data.world.seed=5")
    assert rc == 0, output
    assert "removing the unfinished output of an interrupted" in output
    assert loads(root) == 8 and not (root / ".staging").exists()
    assert (root / "train" / "frames-foo.tar").read_bytes() == b"the user's own shard"
    assert (root / "README").read_text() == "mine"


@pytest.mark.parametrize("point, samples", [("data-swap-aside", 6), ("data-swap-exchanged", 10),
                                           ("data-swap-retire", 10)])
def test_a_kill_at_every_swap_point_leaves_a_usable_dataset_and_the_next_run_finishes(previous, tmp_path, point,
                                                                                       samples):
    """The swap is one directory exchange: killed before it, data.root is the previous dataset byte for byte;
    killed after it, the new one; the user's files are there either way, and the next run finishes the swap."""
    root = copy_of(previous, tmp_path / "data")
    rc, output = make(root, "data.world.scenes=5", fail_at=point)
    assert rc == -9, output
    assert loads(root) == samples  # 6: the previous dataset, 10: the new one; loadable as it is
    assert (root / "train" / "frames-foo.tar").read_bytes() == b"the user's own shard"
    assert (root / "README").read_text() == "mine"
    if samples == 6:
        assert snapshot(root) == previous[1]
    rc, output = make(root, "data.world.scenes=3", "data.world.seed=2")
    assert rc == 0, output
    assert ("completing that swap first" if samples == 6 else "removing the previous dataset") in output
    assert loads(root) == 6 and sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no swap folder or plan
    shards = sorted(p.name for p in (root / "train").glob("*.tar"))
    assert shards == ["frames-000000.tar", "frames-000001.tar", "frames-000002.tar", "frames-000003.tar",
                      "frames-foo.tar"]  # no orphan of either run
    assert (root / "README").read_text() == "mine"


def refuse(monkeypatch, module, name, error, when):
    """Make `module.name` (a writer, a rename) raise `error` (an errno) for the paths `when(*paths)` picks, as the OS
    does: naming the file (and for a link or rename, the target too)."""
    original = getattr(module, name)

    def call(*args, **kwargs):
        paths = [Path(a) for a in args[:2] if isinstance(a, (str, os.PathLike))]
        if when(*paths):
            target = (None, str(paths[1])) if len(paths) > 1 else ()  # OSError's filename2 (winerror before it)
            raise OSError(error, os.strerror(error), *map(str, paths[:1]), *target)
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, call)


@pytest.mark.parametrize("missing", ["no RENAME_EXCHANGE", "data.root is a mount point",
                                     "data.root's parent folder is read-only", "no hard links"])
def test_without_the_exchange_the_swap_renames_in_place(previous, tmp_path, monkeypatch, missing):
    """Where RENAME_EXCHANGE is missing, your files cannot be linked into the new tree (EPERM: a file system without
    hard links), or the staging folder cannot be set aside beside data.root (a mount point: EXDEV; a read-only
    parent: EACCES, for its plan and for the rename), the swap falls back to renames in place:
    the new dataset is in, the user's files stay (one named like the swap's own temporary file too), nothing is
    left beside data.root."""
    import errno

    from stack.config import load_pipeline
    from stack.data import staging
    from stack.data.make import make_dataset

    root = copy_of(previous, tmp_path / "data")
    (root / ".swap.json.partial").write_text("mine too")
    if missing == "no RENAME_EXCHANGE":
        monkeypatch.setattr(staging, "exchange", lambda a, b: False)
    elif missing == "data.root is a mount point":
        refuse(monkeypatch, staging.os, "rename", errno.EXDEV, lambda source, target: target.name.endswith(".swap"))
    elif missing == "no hard links":
        refuse(monkeypatch, staging.os, "link", errno.EPERM, lambda source, target: True)
    else:
        refuse(monkeypatch, staging, "write_durably", errno.EACCES, lambda path: path.parent == tmp_path)
        refuse(monkeypatch, staging.os, "rename", errno.EACCES, lambda source, target: target.parent == tmp_path)
    make_dataset(load_pipeline(overrides=[*SMALL, f"data.root={root}", "data.world.scenes=5"]), log=lambda *_: None)
    assert loads(root) == 10 and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert (root / "train" / "frames-foo.tar").read_bytes() == b"the user's own shard"
    assert (root / "README").read_text() == "mine" and not (root / ".staging").exists()
    assert (root / ".swap.json.partial").read_text() == "mine too"


def listed_and_yours(root) -> bool:
    """data.root's shards are exactly those its manifest lists, and the user's own `frames-foo.tar`: no orphan."""
    from stack.data.format import dataset_files

    listed = {Path(p).name for p in dataset_files(root) if p.startswith("train/") and p.endswith(".tar")}
    return sorted(p.name for p in (root / "train").glob("*.tar")) == sorted(listed | {"frames-foo.tar"})


@pytest.mark.slow  # two `stack data make` processes per kill point
@pytest.mark.parametrize("point, samples", [("data-swap-planned", 6), ("data-swap-files", 6),
                                           ("data-swap-switched", 10), ("data-swap-delete", 10)])
def test_a_kill_at_every_in_place_swap_point_leaves_a_usable_dataset(previous, tmp_path, point, samples):
    """Renaming in place (here: `stack data make` run from inside data.root, which the exchange would retire), the
    new shards go in under names the previous dataset does not use, manifest.json is replaced in one rename, and
    the previous shards are deleted only then: killed at any step, data.root loads as the previous dataset (its
    files unchanged) or the new one, and the next run finishes the swap and says so."""
    root = copy_of(previous, tmp_path / "data")
    rc, output = make(root, "data.world.scenes=5", fail_at=point, cwd=root / "train")
    assert rc == -9, output
    assert loads(root) == samples
    if samples == 6:
        after = snapshot(root)
        assert {name: after.get(name) for name in previous[1]} == previous[1]
    assert (root / "train" / "frames-foo.tar").read_bytes() == b"the user's own shard"
    assert (root / "README").read_text() == "mine"
    rc, output = make(root, "data.world.scenes=3", "data.world.seed=2")
    assert rc == 0, output
    assert "killed while swapping its finished dataset in; completing that swap first" in output
    assert loads(root) == 6 and listed_and_yours(root) and not (root / ".staging").exists()
    assert (root / "README").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_dataset_swapped_in_place_under_other_names_is_the_same_data(previous, tmp_path, monkeypatch):
    """The same dataset rendered again and swapped in place takes `.1` names (the previous one holds the plain ones);
    its fingerprint, which checkpoints record, is the previous one's: a model is not warned it saw other data."""
    from stack.config import load_pipeline
    from stack.data.make import make_dataset
    from stack.lineage import dataset_fingerprint

    root = copy_of(previous, tmp_path / "data")
    monkeypatch.chdir(root / "train")  # working inside data.root: the swap renames in place
    make_dataset(load_pipeline(overrides=[*SMALL, f"data.root={root}", "data.world.scenes=3"]), log=lambda *_: None)
    assert sorted(p.name for p in (root / "train").glob("*.tar"))[0] == "frames-000000.1.tar"
    assert dataset_fingerprint(root)["hash"] == dataset_fingerprint(previous[0])["hash"]


def fill_disk(monkeypatch, root: Path, step: str) -> str:
    """Make the disk fill up (ENOSPC, or EFBIG as `ulimit -f` gives) at `step` of the swap; returns the path the
    error names ("" when the OS names none, as for fsync)."""
    import errno

    from stack.data import staging

    stage, beside = root / ".staging", root.parent
    in_place = step.startswith("in place")
    if in_place:
        monkeypatch.setattr(staging, "exchange", lambda a, b: False)
    if step == "linking your files":
        refuse(monkeypatch, staging.os, "link", errno.ENOSPC, lambda source, target: stage in target.parents)
        return f"({stage / 'README'})"
    if step == "fsync":
        refuse(monkeypatch, staging, "fsync_tree", errno.ENOSPC, lambda folder: True)
        return ""
    if step in ("writing the exchange plan", "in place: writing the plan"):
        folder = stage if in_place else beside
        refuse(monkeypatch, staging, "write_durably", errno.EFBIG, lambda path: path.parent == folder)
        return f"({folder / ('.swap.json.partial' if in_place else '.data.swap.json.partial')})"
    if step == "in place: moving the shards in":
        moved = []

        def third_shard(source, target):
            moved.extend([target] if stage in source.parents and stage not in target.parents else [])
            return len(moved) == 3
        refuse(monkeypatch, staging.os, "rename", errno.ENOSPC, third_shard)
        refuse(monkeypatch, staging.os, "replace", errno.ENOSPC, third_shard)
        return f"{root / 'train'}/"
    if step == "in place: writing the manifest":
        refuse(monkeypatch, staging, "write_durably", errno.EFBIG,
               lambda path: path.parent == stage and "manifest" in path.name)
        return f"({stage}/"
    exchanged = []  # "after the exchange": an fsync of the folder holding both entries reports the full disk
    monkeypatch.setattr(staging, "exchange", lambda a, b, swap=staging.exchange: exchanged.append(1) or swap(a, b))
    refuse(monkeypatch, staging, "fsync_dir", errno.ENOSPC, lambda folder: bool(exchanged))
    return ""


@pytest.mark.parametrize("step, holds, says", [
    ("linking your files", 6, "holds the previous dataset as it was"),
    ("fsync", 6, "holds the previous dataset as it was"),
    ("writing the exchange plan", 6, "holds the previous dataset as it was"),
    ("in place: writing the plan", 6, "holds the previous dataset as it was"),
    ("in place: moving the shards in", 6, "holds the previous dataset, unchanged"),
    ("in place: writing the manifest", 6, "holds the previous dataset, unchanged"),
    ("after the exchange", 10, "holds the new dataset")])
def test_a_full_disk_during_the_swap_is_one_line_and_loses_nothing(previous, tmp_path, monkeypatch, step, holds,
                                                                   says):
    """No room while the finished dataset is swapped in (the links of your files, a plan, an fsync, a rename, the
    new manifest): one line (exit 2) naming data.root and the file, saying nothing was lost and what data.root
    holds now; data.root loads as that dataset with your files, and the next run (with room) finishes or redoes
    the swap."""
    from stack.config import load_pipeline
    from stack.data.make import make_dataset
    from stack.durable import DiskFull

    root = copy_of(previous, tmp_path / "data")
    named = fill_disk(monkeypatch, root, step)
    with pytest.raises(DiskFull) as raised:
        make_dataset(load_pipeline(overrides=[*SMALL, f"data.root={root}", "data.world.scenes=5"]), log=lambda *_: None)
    message = str(raised.value)
    assert raised.value.exit_code == 2 and message.startswith(f"no room to write under '{root}'") and named in message
    assert f"Nothing was lost: data.root='{root}' {says}" in message, message
    monkeypatch.undo()
    assert loads(root) == holds and (root / "README").read_text() == "mine"
    assert (root / "train" / "frames-foo.tar").read_bytes() == b"the user's own shard"
    if says.endswith("as it was"):  # nothing pending: the new dataset was removed, its space given back
        assert snapshot(root) == previous[1] and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    elif holds == 6:  # pending: the previous dataset's files are as they were, the new one waits beside them
        after = snapshot(root)
        assert {name: after.get(name) for name in previous[1]} == previous[1]
    lines = []
    make_dataset(load_pipeline(overrides=[*SMALL, f"data.root={root}", "data.world.scenes=3", "data.world.seed=2"]),
                 log=lines.append)
    if not says.endswith("as it was"):  # the next run finishes the swap it finds, and says so
        assert ("removing the previous dataset" if holds == 10 else "completing that swap first") in "".join(lines)
    assert loads(root) == 6 and listed_and_yours(root) and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def default_sigint() -> None:
    """The child gets Ctrl-C's default action even when this run was started in the background (where a shell
    ignores SIGINT, and Python then installs no KeyboardInterrupt handler), as a user's terminal gives it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_rendering_exits_130_and_keeps_the_dataset(previous, tmp_path):
    import signal

    root = copy_of(previous, tmp_path)
    process = subprocess.Popen([sys.executable, "-m", "stack", "data", "make", *SMALL, f"data.root={root}",
                                "data.world.scenes=24"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                               preexec_fn=default_sigint)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "scene 1/24 written" in line:  # 23 scenes still to render: the signal lands mid-render
            process.send_signal(signal.SIGINT)
            break
    output = "".join(lines) + process.stdout.read()
    assert process.wait(timeout=120) == 130, output
    assert "interrupted" in output and "Traceback" not in output
    kept = {name: data for name, data in snapshot(root).items() if not name.startswith(".staging")}
    assert kept == previous[1] and loads(root) == 6


def test_a_user_file_where_a_new_shard_goes_stops_the_run_before_anything_changes(tmp_path, small_pipeline):
    from stack.data.make import make_dataset

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "frames-000000.tar").write_bytes(b"not ours")
    pipeline = small_pipeline(tmp_path, "data.world.scenes=1", "data.world.frames_per_scene=1")
    with pytest.raises(StackError, match=r"holds train/frames-000000\.tar, which no manifest lists"):
        make_dataset(pipeline, log=lambda *_: None)
    assert (tmp_path / "train" / "frames-000000.tar").read_bytes() == b"not ours"
    assert json.loads(json.dumps(sorted(p.name for p in tmp_path.rglob("*")))) == ["frames-000000.tar", "train"]


def test_a_manifest_naming_files_outside_the_dataset_never_gets_them_deleted(previous, tmp_path):
    root = copy_of(previous, tmp_path / "data")
    victim = tmp_path / "elsewhere" / "keep.tar"
    victim.parent.mkdir()
    victim.write_bytes(b"not part of any dataset")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"].append({**manifest["splits"]["train"][0], "path": str(victim)})
    (root / "manifest.json").write_text(json.dumps(manifest))
    rc, output = make(root, "data.world.scenes=3")
    assert rc == 0, output
    assert victim.read_bytes() == b"not part of any dataset"


def test_a_second_writer_on_the_same_data_root_is_refused(previous, tmp_path):
    import fcntl

    root = copy_of(previous, tmp_path)
    before = snapshot(root)
    held = os.open(root, os.O_RDONLY)  # the lock a `stack data make` still running would hold
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, output = make(root, "data.world.scenes=3")
    finally:
        os.close(held)
    assert rc == 2 and "another `stack data make`" in output and "Traceback" not in output, output
    assert snapshot(root) == before


def test_a_full_disk_while_rendering_is_one_line_and_keeps_the_previous_dataset(previous, tmp_path):
    """A file-size limit (as `ulimit -f` sets; a full disk raises the same way) stops the run with one line naming
    the folder and saying the previous dataset is intact; the partial staging folder is removed."""
    root = copy_of(previous, tmp_path)
    rc, output = make(root, "data.world.scenes=4", "data.world.seed=5", file_limit=20_000)
    assert rc == 2 and "Traceback" not in output, output
    assert f"no room to write under '{root / '.staging'}': a file reached the size limit for files (ulimit -f)" \
        in output and f"The dataset in data.root='{root}' is as it was" in output, output
    assert snapshot(root) == previous[1] and not (root / ".staging").exists()
    assert loads(root) == 6


@pytest.mark.parametrize("how", ["data.root is a link to the folder", "run from inside data.root"])
def test_a_linked_data_root_stays_a_link_and_a_working_folder_inside_stays(previous, tmp_path, monkeypatch, how):
    """The exchange swaps the folder itself (beside its real path), never a link to it; a process working inside
    data.root swaps in place, so its working folder is not retired with the previous dataset."""
    from stack.config import load_pipeline
    from stack.data.make import make_dataset

    real = copy_of(previous, tmp_path / "real")
    root = real
    if how == "data.root is a link to the folder":
        root = tmp_path / "link"
        root.symlink_to(real)
    else:
        monkeypatch.chdir(real / "train")
    make_dataset(load_pipeline(overrides=[*SMALL, f"data.root={root}", "data.world.scenes=5"]), log=lambda *_: None)
    assert loads(root) == 10 and (root / "README").read_text() == "mine"
    assert (real / "train" / "frames-foo.tar").read_bytes() == b"the user's own shard"
    assert root.is_symlink() == (how == "data.root is a link to the folder") and Path(os.getcwd()).exists()
    assert not list(tmp_path.glob(".*.swap*"))


def test_the_staged_tree_is_durable_before_the_exchange(previous, tmp_path, monkeypatch):
    """Every file and folder of the new dataset is fsync'd before it is exchanged, and the folder holding both
    entries after: a power cut cannot leave data.root naming a tree whose blocks never reached the disk."""
    from stack.config import load_pipeline
    from stack.data import staging
    from stack.data.make import make_dataset

    root, events = copy_of(previous, tmp_path / "data"), []

    def recorded(name):
        original = getattr(staging, name)

        def call(*args):
            events.append((name, *map(str, args)))
            return original(*args)
        return call
    for name in ("fsync_tree", "fsync_dir", "exchange"):
        monkeypatch.setattr(staging, name, recorded(name))
    make_dataset(load_pipeline(overrides=[*SMALL, f"data.root={root}", "data.world.scenes=5"]), log=lambda *_: None)
    swap = str(tmp_path / ".data.swap")
    assert events.index(("fsync_tree", str(root / ".staging"))) < events.index(("exchange", swap, str(root)))
    assert ("fsync_dir", str(tmp_path)) in events[events.index(("exchange", swap, str(root))):]
    assert loads(root) == 10
