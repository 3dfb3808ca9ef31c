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
parent folder, a file system without hard links or RENAME_EXCHANGE, or this process working inside `data.root`)
the swap renames in place, ordered so that `data.root/manifest.json` names a complete dataset at every instant:

1. the staged files are fsync'd and a plan (`.staging/swap.json`) is written: the previous dataset's files, and
   the names the new ones take in `data.root`: their own (`train/frames-000000.tar`), or where the previous
   dataset (or anything else) holds one of those, the first free `train/frames-000000.1.tar`, `.2`, ... for all;
2. the new shards and sidecars are renamed into `data.root` under those names (the previous ones untouched);
3. the new manifest, naming them, replaces `manifest.json` in one rename: the switch;
4. the previous dataset's files are deleted, then the staging folder.

Only files a manifest lists are ever deleted or replaced: a user's own `frames-foo.tar` beside the shards
survives, and a user file in the way of a new shard stops the run before anything changes.

A full disk, a quota or a file-size limit anywhere in the swap stops it with one line (`stack.durable.disk_full`)
naming the file that needed the room and what `data.root` holds: the previous dataset while the switch has not
happened (with the new one kept where a plan says the next run finishes the swap, and removed, its space given
back, where no plan refers to it yet), the new one after it.

A data folder may come from someone else, `.staging/` included, so nothing in it is trusted: a swap plan
carries a sha256 over its own content and over the staging manifest it belongs to (an edited, torn or
foreign plan is refused), and every path a plan or a manifest names must be a shard or sidecar
relative to its dataset, without `..`, and reached through no symbolic link (checked before the first
change). Anything else stops the run with exit 2 and nothing deleted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from stack.data.format import MANIFEST, SIDECARS, dataset_files, manifest_files, manifest_text
from stack.durable import FULL, disk_full, exchange, fsync_dir, fsync_tree, write_durably
from stack.errors import StackError
from stack.failpoints import fail_point
from stack.locks import exchanged as exchanged_locks, hold_folder, release_folder
from stack.safe_values import escaped
from stack.user_json import parse_json, read_json

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
    with disk_full(root, lambda: _after_full_disk(root)):
        _finish_interrupted(root, staging, log)
    return staging


def _finish_interrupted(root: Path, staging: Path, log) -> None:
    """Finish the swap a killed run left (it planned it), or remove its unfinished staging folder; said either way."""
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
    """Swap the complete dataset in the staging folder into `root`; returns its manifest. No room on the way is
    one line saying what `root` holds now (`_after_full_disk`)."""
    with disk_full(root, lambda: _after_full_disk(root)):
        return _commit(root, log)


def _commit(root: Path, log) -> dict:
    """The exchange where it can be made, else the in-place swap; one a killed run planned is finished in place."""
    root, staging = Path(root), staging_folder(root)
    manifest_bytes = (staging / MANIFEST).read_bytes()
    manifest = _parse_staged(staging, manifest_bytes)
    if not (staging / PLAN).is_file():
        new = manifest_files(manifest)
        check_free(root, new)
        check_paths(root, dataset_files(root) + new, "data.root's manifest or the staging manifest")
        check_paths(staging, new, "the staging manifest")
        fail_point("data-swap")
        if _swap_by_exchange(root, staging, manifest_bytes, log):
            return manifest
        _plan_in_place(root, staging, new, manifest_bytes)
    _swap_in_place(root, staging, manifest, manifest_bytes)
    return manifest


def _parse_staged(staging: Path, manifest_bytes: bytes) -> dict:
    """The staging manifest as a dict; a torn or foreign one stops the run before anything changes."""
    return parse_json(manifest_bytes, escaped(str(staging / MANIFEST)), "a manifest `stack data make` wrote",
                      f"Nothing was changed. Remove {escaped(str(staging))} and run again.")


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
    try:
        _link_user_files(root, staging, set(dataset_files(root)) | {MANIFEST})  # EPERM: no hard links here
        fsync_tree(staging)
        _write_record(plan, {"manifest_sha256": _sha256(manifest_bytes)})  # EACCES, EROFS: a read-only parent
        os.rename(staging, aside)  # EXDEV: data.root is a mount point
    except OSError as exc:
        plan.unlink(missing_ok=True)
        if exc.errno in FULL or exc.errno == errno.EIO:  # no room, or a lost write: the in-place swap cannot help
            raise
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


def _plan_in_place(root: Path, staging: Path, new: list[str], manifest_bytes: bytes) -> None:
    """Step 1 of the in-place swap: the staged files durable, then the plan that lets the next run finish it."""
    old = dataset_files(root)
    fsync_tree(staging)
    _write_record(staging / PLAN, {"delete": old, "manifest_sha256": _sha256(manifest_bytes),
                                   "suffix": _free_suffix(root, new, old)})
    fail_point("data-swap-planned")


def _free_suffix(root: Path, new: list[str], old: list[str]) -> int:
    """The first n (0: the staged names themselves) for which no new file's name in `root` is taken, by the
    previous dataset's manifest or by any file: until the switch, the previous dataset must stay whole."""
    taken = set(old)
    for suffix in range(100):
        names = [_renamed(path, suffix) for path in new]
        if not any(name in taken or os.path.lexists(root / name) for name in names):
            return suffix
    raise StackError(f"data.root={str(root)!r} holds a file under every name the new dataset's files could take "
                     f"({new[0]}, and the same with .1 to .99 before the extension); nothing was changed. Remove the "
                     "files no manifest lists, and run again")


def _renamed(path: str, suffix: int) -> str:
    """`train/frames-000000.tar` as the in-place swap names it in data.root: `train/frames-000000.1.tar` for 1."""
    relative = Path(path)
    return path if not suffix else str(relative.with_name(f"{relative.stem}.{suffix}{relative.suffix}"))


def _swap_in_place(root: Path, staging: Path, manifest: dict, manifest_bytes: bytes) -> None:
    """Steps 2-4 of the in-place swap, as the plan says; a step a killed run already made is not made again."""
    old, targets, final = _in_place_plan(root, staging, manifest, manifest_bytes)
    if _manifest_sha(root) != _sha256(final):
        _move_in(root, staging, manifest_files(manifest), targets)
        _switch(root, staging, final)
    fail_point("data-swap-switched")
    keep = set(targets)
    for index, path in enumerate(old):
        if index == len(old) // 2:
            fail_point("data-swap-delete")
        if path not in keep:
            (root / path).unlink(missing_ok=True)
    shutil.rmtree(staging)
    fsync_dir(root)


def _in_place_plan(root: Path, staging: Path, manifest: dict, manifest_bytes: bytes) -> tuple[list, list, bytes]:
    """The checked plan of an in-place swap: the previous dataset's files, the names the staged files take in
    `root`, and the manifest that names them there (the staged one, its paths renamed)."""
    record = read_plan(staging / PLAN, manifest_bytes)
    new = manifest_files(manifest)
    targets = [_renamed(path, record["suffix"]) for path in new]
    check_paths(root, record["delete"] + targets, "data.root's manifest or the swap plan")
    check_paths(staging, new, "the staging manifest")
    if not record["suffix"] or not new:
        return record["delete"], targets, manifest_bytes
    renamed = {split: [{**entry, "path": _renamed(entry["path"], record["suffix"])}
                       if isinstance(entry["path"], str) else entry for entry in entries]
               for split, entries in manifest["splits"].items()}  # manifest_files read every entry's path
    return record["delete"], targets, manifest_text({**manifest, "splits": renamed}).encode()


def _move_in(root: Path, staging: Path, new: list[str], targets: list[str]) -> None:
    """Step 2: rename each staged file into `root` under its planned name; the previous dataset is untouched."""
    for index, (path, target) in enumerate(zip(new, targets)):
        if index == len(new) // 2:
            fail_point("data-swap-files")
        source, target = staging / path, root / target
        if not os.path.lexists(source):
            continue  # moved before the run that planned this swap was killed
        if os.path.lexists(target):
            raise StackError(f"{str(target)!r} appeared where the new dataset's {path} goes while it was being "
                             f"swapped in; nothing was deleted and data.root still holds the previous dataset. Move "
                             "that file away and run again: the run finishes this swap first")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, target)
    for folder in sorted({(root / target).parent for target in targets}):
        fsync_dir(folder)  # the renames durable before a manifest names them


def _switch(root: Path, staging: Path, final: bytes) -> None:
    """Step 3: the manifest naming the new files replaces data.root's in one rename."""
    temporary = staging / f".{MANIFEST}.final"
    write_durably(temporary, final)
    os.replace(temporary, root / MANIFEST)
    fsync_dir(root)


def _after_full_disk(root: Path) -> str:
    """What `root` holds after no room stopped a swap, as the next run will find it. A staging folder no plan
    refers to (the next run would remove it) is removed now, to give its space back."""
    root, staging, aside = Path(root), staging_folder(root), swap_folder(root)
    said = f"Nothing was lost: data.root={str(root)!r} holds"
    if _exchange_plan(root).is_file():
        if _manifest_sha(root) == _read_record(_exchange_plan(root), {"manifest_sha256"})["manifest_sha256"]:
            return f"{said} the new dataset, with your files; the next run removes what is left of the previous one " \
                   f"in {str(aside)!r}"
        return f"{said} the previous dataset, unchanged; the new one waits complete in {str(aside)!r} and the next " \
               "run swaps it in first"
    if (staging / PLAN).is_file():
        manifest_bytes = (staging / MANIFEST).read_bytes()
        final = _in_place_plan(root, staging, _parse_staged(staging, manifest_bytes), manifest_bytes)[2]
        if _manifest_sha(root) == _sha256(final):
            return f"{said} the new dataset, with your files; the next run deletes the previous dataset's shards"
        return f"{said} the previous dataset, unchanged; the new one waits complete, in {str(staging)!r} and (under " \
               "names the previous one does not use) in data.root, and the next run swaps it in first"
    if staging.exists():
        shutil.rmtree(staging)
        return f"{said} the previous dataset as it was; the new one, in {str(staging)!r}, was removed to give its " \
               "space back"
    return f"{said} the new dataset, with your files"


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_sha(folder: Path) -> str | None:
    path = Path(folder) / MANIFEST
    return _sha256(path.read_bytes()) if path.is_file() and not path.is_symlink() else None


def _write_record(path: Path, body: dict) -> None:
    """A plan with its own sha256, written durably (file, then folder) before the step it plans; on a failed
    write (no room) no part of it is left."""
    temp = path.with_name(f".{path.name.lstrip('.')}.partial")
    try:
        write_durably(temp, (json.dumps({**body, "sha256": _digest(body)}) + "\n").encode())
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _read_record(path: Path, keys: set) -> dict:
    """The body of a plan `_write_record` wrote with exactly `keys`; a StackError (nothing changed) otherwise."""
    try:
        record = read_json(path, "a swap plan", "")
    except StackError as exc:
        _refuse_plan(path, f"unreadable: {str(exc).removeprefix(escaped(str(path)) + ': ').strip()}")
    if set(record) != keys | {"sha256"}:
        _refuse_plan(path, f"not a swap plan of this version (expected the keys {', '.join(sorted(keys))}, sha256)")
    body = {key: record[key] for key in keys}
    if record["sha256"] != _digest(body):
        _refuse_plan(path, "its sha256 does not match its content (edited or torn)")
    return body


def read_plan(plan: Path, manifest_bytes: bytes) -> dict:
    """An in-place swap's plan (the previous dataset's files to `delete`, the `suffix` of the new files' names),
    if `plan` is one `stack data make` wrote for this staging manifest; a StackError (nothing changed) otherwise."""
    record = _read_record(plan, {"delete", "manifest_sha256", "suffix"})
    if record["manifest_sha256"] != hashlib.sha256(manifest_bytes).hexdigest():
        _refuse_plan(plan, "it was written for another staging manifest")
    if not isinstance(record["delete"], list):
        _refuse_plan(plan, f"its delete entry is a {type(record['delete']).__name__}, not a list of files")
    if type(record["suffix"]) is not int or not 0 <= record["suffix"] < 100:
        _refuse_plan(plan, f"its suffix is {record['suffix']!r:.40}, not a number from 0 to 99")
    return record


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
