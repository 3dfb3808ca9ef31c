"""Replace a dataset only once its successor is complete: render into a staging folder, then swap.

`stack data make` renders into `data.root/.staging/` (same file system as the dataset, so
each move is a rename), writes the staging manifest last, and only then swaps: the old
manifest goes first (a dataset without a manifest is refused by the loaders, never read
half old, half new), then the shards the old manifest listed, then the new shards move in
and the new manifest is renamed into place. Until the swap starts, a kill or Ctrl-C leaves
the previous dataset exactly as it was; the swap itself is a few renames, and its plan
(`swap.json`, the old files to delete) is written before it begins, so the next run
finishes an interrupted swap instead of leaving orphans. Only files a manifest lists are
ever deleted or replaced: a user's own `frames-foo.tar` beside the shards survives, and a
user file in the way of a new shard stops the run before anything changes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from stack.data.format import MANIFEST, dataset_files, manifest_files
from stack.errors import StackError
from stack.failpoints import fail_point

STAGING = ".staging"
PLAN = "swap.json"


def staging_folder(root: Path) -> Path:
    return Path(root) / STAGING


_held: dict[str, int] = {}


def lock(root: Path) -> None:
    """Hold the writer lock on the `root` folder itself for the rest of this process.

    Two `stack data make`/`convert` runs on one data.root would share the one staging folder and
    remove each other's work; the second is refused instead. flock(2) on the directory: no lock
    file is left in the user's folder, and the kernel drops the lock when the process ends.
    """
    import fcntl

    key = str(Path(root).resolve())
    if key in _held:
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    handle = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise StackError(f"another `stack data make` or `stack data convert` is writing data.root={str(root)!r}; "
                         f"wait for it to finish, or write to another data.root") from None
    _held[key] = handle


def prepare(root: Path, log: Callable[[str], None]) -> Path:
    """The staging folder under `root` (not created yet); one left by a killed run is finished or removed, and said so.

    Takes `root`'s writer lock first (`lock`)."""
    lock(root)
    staging = staging_folder(root)
    if (staging / PLAN).is_file() and (staging / MANIFEST).is_file():
        log(f"{staging}: a previous `stack data make` was killed while swapping its finished dataset in; "
            "completing that swap first")
        commit(root, log)
    elif staging.exists():
        log(f"{staging}: removing the unfinished output of an interrupted `stack data make` "
            "(the dataset in data.root was not touched by it)")
        shutil.rmtree(staging)
    return staging


def check_free(root: Path, paths: list[str]) -> None:
    """Refuse (before any work) when a file that no manifest lists sits where a new shard will go."""
    listed = set(dataset_files(root))
    taken = [p for p in paths if (Path(root) / p).exists() and p not in listed]
    if taken:
        raise StackError(f"data.root={str(root)!r} holds {', '.join(taken)}, which no manifest lists: the new dataset "
                         "would overwrite it. Move those files away, or set data.root to another folder; "
                         "`stack data make` only replaces files its manifest lists")


def commit(root: Path, log: Callable[[str], None]) -> dict:
    """Swap the complete dataset in the staging folder into `root`; returns its manifest."""
    staging = staging_folder(root)
    manifest = json.loads((staging / MANIFEST).read_text())
    new = manifest_files(manifest)
    plan = staging / PLAN
    if plan.is_file():
        old = json.loads(plan.read_text())["delete"]
    else:
        check_free(root, new)
        old = [p for p in dataset_files(root) if p not in new]
        fail_point("data-swap")
        _write_atomically(plan, json.dumps({"delete": old}) + "\n")
    (Path(root) / MANIFEST).unlink(missing_ok=True)
    for path in old:
        (Path(root) / path).unlink(missing_ok=True)
    for index, path in enumerate(new):
        if index == len(new) // 2:
            fail_point("data-swap-files")
        source, target = staging / path, Path(root) / path
        if source.exists():  # absent: moved before an interrupted swap
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
    os.replace(staging / MANIFEST, Path(root) / MANIFEST)
    shutil.rmtree(staging)
    return manifest


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(text)
    os.replace(temp, path)
