"""Replace a dataset only once its successor is complete: render into a staging folder, then swap.

`stack data make` renders into `data.root/.staging/` (same file system as the dataset) and writes the
staging manifest last. Until the swap starts, a kill or Ctrl-C leaves the previous dataset exactly as it
was. The swap is one directory exchange, so that at every instant `data.root` holds a whole dataset, the
previous one or the new one, never a mix and never none:

1. every file of `data.root` that is not the dataset (your own files; `.staging` aside) is hard-linked into
   the staging folder at the same place, and the staging folder is fsync'd, file by file and folder by folder;
2. a plan (`.NAME.swap.json` beside `data.root`, bound to the staging manifest by its sha256) is written, and
   the staging folder is renamed beside `data.root` (`.NAME.swap/`);
3. `renameat2(RENAME_EXCHANGE)` swaps it with `data.root` in one step (`stack.durable.exchange`);
4. the previous dataset, now at `.NAME.swap/`, is retired: the files its manifest lists are deleted, links of
   your files (the same inodes are in the new `data.root`) are dropped, and anything else of yours is moved
   into `data.root`; then the plan is removed.

A kill between any two steps leaves a loadable dataset at `data.root`, and the next run finishes what the
plan says (or says why it cannot). Where the exchange cannot be made (`data.root` a mount point, a read-only
parent folder, a file system or C library without RENAME_EXCHANGE), the swap falls back to renames in place:
the old manifest goes first (a dataset without a manifest is refused by the loaders, never read half old,
half new), then the shards the old manifest listed, then the new shards and the new manifest; its plan
(`.staging/swap.json`, the old files to delete) is written first, so the next run finishes an interrupted
swap. Only files a manifest lists are ever deleted or replaced: a user's own `frames-foo.tar` beside the
shards survives, and a user file in the way of a new shard stops the run before anything changes.

A data folder may come from someone else, `.staging/` included, so nothing in it is trusted: a swap plan
carries a sha256 over its own content and over the staging manifest it belongs to (an edited, torn or
foreign plan is refused), and every path a plan or a manifest names must be a shard or sidecar
relative to its dataset, without `..`, and reached through no symbolic link (checked before the first
change). Anything else stops the run with exit 2 and nothing deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from stack.data.format import MANIFEST, SIDECARS, dataset_files, manifest_files
from stack.durable import exchange, fsync_dir, fsync_tree, write_durably
from stack.errors import StackError
from stack.failpoints import fail_point
from stack.locks import exchanged as exchanged_locks, hold_folder, release_folder

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
    if _recover_exchange(root, log):
        log(f"{staging}: a previous `stack data make` was killed before swapping its finished dataset in; "
            "completing that swap first")
        commit(root, log)
    elif (staging / PLAN).is_file() and (staging / MANIFEST).is_file():
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
        if _swap_by_exchange(root, staging, manifest_bytes, log):
            return manifest
        _write_record(plan, {"delete": old, "manifest_sha256": _sha256(manifest_bytes)})
    _swap(root, staging, old, new)
    return manifest


def swap_folder(root: Path) -> Path:
    """Where the staging folder waits for the exchange, beside data.root (`.NAME.swap`); after the exchange the
    previous dataset is there until it is retired."""
    root = Path(os.path.realpath(root))  # beside the folder itself, not beside a link to it
    return root.parent / f".{root.name}.swap"


def _exchange_plan(root: Path) -> Path:
    return swap_folder(root).with_name(swap_folder(root).name + ".json")


def _swap_by_exchange(root: Path, staging: Path, manifest_bytes: bytes, log) -> bool:
    """Steps 1-4 of the module docstring; False (nothing changed but links in the staging folder) where the
    exchange cannot be made, for the in-place swap to do instead (also when this process works inside data.root:
    the exchange would leave its working folder in the retired dataset)."""
    root, aside, plan = Path(os.path.realpath(root)), swap_folder(root), _exchange_plan(root)
    cwd = Path(os.path.realpath(os.getcwd()))
    if cwd == root or root in cwd.parents:
        return False
    _link_user_files(root, staging, set(dataset_files(root)) | {MANIFEST})
    fsync_tree(staging)
    _write_record(plan, {"manifest_sha256": _sha256(manifest_bytes)})
    try:
        os.rename(staging, aside)  # EXDEV: data.root is a mount point; EACCES: its parent is read-only
    except OSError:
        plan.unlink()
        return False
    fsync_dir(root)
    fsync_dir(aside.parent)
    fail_point("data-swap-aside")
    return _exchange_aside(root, aside, plan, log)


def _exchange_aside(root: Path, aside: Path, plan: Path, log) -> bool:
    """Exchange the complete new dataset at `aside` with data.root, then retire the previous one."""
    hold_folder(aside, f"another process holds {aside}; wait for it to finish")  # data.root's lock, once exchanged
    try:
        exchanged = exchange(aside, root)
    except OSError:
        exchanged = False
    if not exchanged:
        release_folder(aside)
        os.rename(aside, staging_folder(root))
        plan.unlink()
        return False
    exchanged_locks(aside, root)
    fsync_dir(aside.parent)
    fail_point("data-swap-exchanged")
    _retire(aside, root, log)
    release_folder(aside)  # the previous dataset's folder, gone
    plan.unlink()
    fsync_dir(aside.parent)
    return True


def _recover_exchange(root: Path, log) -> bool:
    """Finish an exchange a killed run left (`.NAME.swap.json` beside data.root); True when the complete new
    dataset is back in the staging folder, to be swapped in by `commit`. A plan or folder there that this
    module did not write is refused (exit 2), nothing changed."""
    root, aside, plan = Path(os.path.realpath(root)), swap_folder(root), _exchange_plan(root)
    if not plan.exists() and not os.path.lexists(aside):
        return False
    if os.path.islink(aside) or (aside.exists() and not aside.is_dir()) or not plan.is_file():
        raise StackError(f"{str(aside)!r} is not a swap `stack data make` left (no plan {plan.name} beside it, or "
                         "not a folder); nothing was changed. Remove it (check it holds nothing of yours) and run again")
    expected = _read_record(plan, {"manifest_sha256"})["manifest_sha256"]
    if _manifest_sha(root) == expected:  # exchanged: the previous dataset waits at `aside`
        log(f"{aside}: a previous `stack data make` was killed after swapping its dataset in; removing the "
            "previous dataset")
        if aside.exists():
            _retire(aside, root, log)
    elif aside.is_dir() and _manifest_sha(aside) == expected:  # set aside, not exchanged yet
        os.rename(aside, staging_folder(root))
    elif _manifest_sha(staging_folder(root)) != expected:
        _refuse_plan(plan, "it names a dataset that is neither in data.root nor waiting beside it")
    plan.unlink()
    fsync_dir(aside.parent)
    return (staging_folder(root) / MANIFEST).is_file()


def _link_user_files(root: Path, staging: Path, dataset: set) -> None:
    """Hard-link every file of `root` that is not in `dataset` (the manifest and the files it lists) into
    `staging` at the same place, `.staging` aside: after the exchange they are in data.root as before (the same
    inodes), so retiring the previous dataset's folder deletes only second links."""
    for parent, folders, files in os.walk(root):
        here = Path(parent).relative_to(root)
        if here == Path("."):
            folders[:] = [f for f in folders if f != STAGING]
        links = [f for f in folders if os.path.islink(os.path.join(parent, f))]
        folders[:] = [f for f in folders if f not in links]
        for name in folders:
            (staging / here / name).mkdir(exist_ok=True)
        for name in files + links:
            target = staging / here / name
            if (here / name).as_posix() not in dataset and not os.path.lexists(target):
                os.link(os.path.join(parent, name), target, follow_symlinks=False)


def _retire(old: Path, root: Path, log) -> None:
    """Remove the previous dataset's folder (`old`, after the exchange): delete its manifest and the files it
    lists (checked like any manifest), drop the second links of files that are also in `root`, move anything
    else into `root`; what would overwrite a file of `root` stays, and is said."""
    listed = dataset_files(old)
    check_paths(old, listed, "the previous dataset's manifest")
    for path in [*listed, MANIFEST]:
        (old / path).unlink(missing_ok=True)
    fail_point("data-swap-retire")
    kept = []
    for parent, folders, files in os.walk(old, topdown=False):
        links = [f for f in folders if os.path.islink(os.path.join(parent, f))]
        for name in files + links:
            path = Path(parent) / name
            target = root / path.relative_to(old)
            if os.path.lexists(target) and os.path.samestat(os.lstat(path), os.lstat(target)):
                path.unlink()
            elif not os.path.lexists(target):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.rename(path, target)
            else:
                kept.append(str(path))
        for name in set(folders) - set(links):
            with contextlib.suppress(OSError):  # not empty: it holds what was kept
                os.rmdir(os.path.join(parent, name))
    with contextlib.suppress(OSError):
        os.rmdir(old)
    if kept:
        log(f"{old}: kept {', '.join(kept[:5])}{' ...' if len(kept) > 5 else ''}: files that are not the previous "
            "dataset's and differ from the file at the same place in data.root; move what you need, then remove it")


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
    for folder in sorted({(Path(root) / path).parent for path in new}):
        fsync_dir(folder)  # the shards' renames, durable before the manifest names them
    os.replace(staging / MANIFEST, Path(root) / MANIFEST)
    fsync_dir(Path(root))
    shutil.rmtree(staging)


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_sha(folder: Path) -> str | None:
    path = Path(folder) / MANIFEST
    return _sha256(path.read_bytes()) if path.is_file() and not path.is_symlink() else None


def _write_record(path: Path, body: dict) -> None:
    """A plan with its own sha256, written durably (file, then folder) before the step it plans."""
    temp = path.with_name(f".{path.name}.partial")
    write_durably(temp, (json.dumps({**body, "sha256": _digest(body)}) + "\n").encode())
    os.replace(temp, path)
    fsync_dir(path.parent)


def _read_record(path: Path, keys: set) -> dict:
    """The body of a plan `_write_record` wrote with exactly `keys`; a StackError (nothing changed) otherwise."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _refuse_plan(path, f"unreadable: {exc}")
    if not isinstance(record, dict) or set(record) != keys | {"sha256"}:
        _refuse_plan(path, f"not a swap plan of this version (expected the keys {', '.join(sorted(keys))}, sha256)")
    body = {key: record[key] for key in keys}
    if record["sha256"] != _digest(body):
        _refuse_plan(path, "its sha256 does not match its content (edited or torn)")
    return body


def read_plan(plan: Path, manifest_bytes: bytes) -> list[str]:
    """The files an interrupted swap still has to delete, if `plan` is one `stack data make` wrote for this staging
    manifest; a StackError (nothing changed) for anything else."""
    record = _read_record(plan, {"delete", "manifest_sha256"})
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
