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

A data folder may come from someone else, `.staging/` included, so nothing in it is trusted: the swap plan
carries a sha256 over its own content and over the staging manifest it belongs to (an edited, torn or
foreign plan is refused), and every path the plan or a manifest names must be a shard or sidecar
relative to `data.root`, without `..`, and reached through no symbolic link (checked before the first
change). Anything else stops the run with exit 2 and nothing deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from stack.data.format import MANIFEST, SIDECARS, dataset_files, manifest_files
from stack.errors import StackError
from stack.failpoints import fail_point
from stack.locks import hold_folder

STAGING = ".staging"
PLAN = "swap.json"


def staging_folder(root: Path) -> Path:
    return Path(root) / STAGING


def lock(root: Path) -> None:
    """Hold the writer lock on the `root` folder for the rest of this process (`stack.locks`): two
    `stack data make`/`convert` runs on one data.root would share the one staging folder and remove each
    other's work; the second is refused instead."""
    hold_folder(root, f"another `stack data make` or `stack data convert` is writing data.root={str(root)!r}; "
                      f"wait for it to finish, or write to another data.root")


def prepare(root: Path, log: Callable[[str], None]) -> Path:
    """The staging folder under `root` (not created yet); one left by a killed run is finished or removed, and said so.

    Takes `root`'s writer lock first (`lock`)."""
    lock(root)
    staging = staging_folder(root)
    _check_staging_folder(staging)
    if (staging / PLAN).is_file() and (staging / MANIFEST).is_file():
        log(f"{staging}: a previous `stack data make` was killed while swapping its finished dataset in; "
            "completing that swap first")
        commit(root, log)
    elif staging.exists():
        log(f"{staging}: removing the unfinished output of an interrupted `stack data make` "
            "(the dataset in data.root was not touched by it)")
        shutil.rmtree(staging)
    return staging


def _check_staging_folder(staging: Path) -> None:
    """`.staging` is a real folder or absent: a link (or a file) there is not what `stack data make` made, and
    following it would move or delete files elsewhere."""
    if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
        kind = "a symbolic link" if staging.is_symlink() else "not a folder"
        raise StackError(f"{str(staging)!r} is {kind}; `stack data make` only ever makes a folder there. Nothing "
                         "was changed. Remove it (it was not written by `stack data make`) and run again")


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
    manifest_bytes = (staging / MANIFEST).read_bytes()
    manifest = json.loads(manifest_bytes)
    new = manifest_files(manifest)
    plan = staging / PLAN
    if plan.is_file():
        old = read_plan(plan, manifest_bytes)
    else:
        check_free(root, new)
        old = [p for p in dataset_files(root) if p not in new]
    check_paths(root, old + new, "data.root's manifest or the swap plan")
    check_paths(staging, new, "the staging manifest")
    if not plan.is_file():
        fail_point("data-swap")
        _write_atomically(plan, json.dumps(_plan_record(old, manifest_bytes)) + "\n")
    _swap(root, staging, old, new)
    return manifest


def _swap(root: Path, staging: Path, old: list[str], new: list[str]) -> None:
    """The renames and deletions of a checked plan: old manifest, old shards, new shards, new manifest."""
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


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _plan_record(old: list[str], manifest_bytes: bytes) -> dict:
    """The swap plan as written: the files to delete, bound to the staging manifest, and a sha256 over both."""
    body = {"delete": old, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
    return {**body, "sha256": _digest(body)}


def read_plan(plan: Path, manifest_bytes: bytes) -> list[str]:
    """The files an interrupted swap still has to delete, if `plan` is one `stack data make` wrote for this staging
    manifest; a StackError (nothing changed) for anything else."""
    try:
        record = json.loads(plan.read_text())
    except (OSError, ValueError) as exc:
        _refuse_plan(plan, f"unreadable: {exc}")
    if not isinstance(record, dict) or set(record) != {"delete", "manifest_sha256", "sha256"}:
        _refuse_plan(plan, "not a swap plan of this version (expected the keys delete, manifest_sha256, sha256)")
    body = {"delete": record["delete"], "manifest_sha256": record["manifest_sha256"]}
    if record["sha256"] != _digest(body):
        _refuse_plan(plan, "its sha256 does not match its content (edited or torn)")
    if record["manifest_sha256"] != hashlib.sha256(manifest_bytes).hexdigest():
        _refuse_plan(plan, "it was written for another staging manifest")
    if not isinstance(record["delete"], list):
        _refuse_plan(plan, f"its delete entry is a {type(record['delete']).__name__}, not a list of files")
    return record["delete"]


def _refuse_plan(plan: Path, why: str):
    raise StackError(f"{str(plan)!r} is not a swap plan `stack data make` wrote ({why}); nothing was changed. "
                     f"Check data.root's files, then remove {str(plan.parent)!r} and run again")


def check_paths(root: Path, paths: list, source: str) -> None:
    """Each path is a shard or sidecar inside `root`: relative, without `..`, reached through no symbolic link.
    Checked before the first change, so a refused plan deletes nothing."""
    real_root = os.path.realpath(root)
    for path in paths:
        problem = _path_problem(Path(root), real_root, path)
        if problem:
            raise StackError(f"{source} names {str(path)[:200]!r}, which {problem}; `stack data make` only deletes "
                             f"or replaces shards (.tar{''.join(', ' + s for s in SIDECARS)}) inside "
                             f"{str(root)!r}. Nothing was changed: check that folder and remove what you did not "
                             "put there")


def _path_problem(root: Path, real_root: str, path) -> str | None:
    """Why `path` may not be deleted or replaced under `root` (None when it may)."""
    if not isinstance(path, str) or not path:
        return "is not a file name"
    relative = Path(path)
    if relative.is_absolute() or ".." in relative.parts:
        return "is not a path inside the folder"
    if relative.suffix not in (".tar", *SIDECARS):
        return "is not a shard or sidecar"
    full = root / relative
    if full.is_symlink() or os.path.realpath(full.parent) != os.path.join(real_root, *relative.parent.parts):
        return "is reached through a symbolic link"
    return None


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(text)
    os.replace(temp, path)
