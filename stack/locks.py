"""Writer locks on output folders: one process writes a folder at a time.

Two runs writing one folder at once mix their results without a word (two `stack train` runs in one
`train.out_dir` interleave `metrics.csv`, and `model.pt` holds one run's weights while the other reports
them as its own; two `stack data make` runs share one staging folder). The second is refused instead.
flock(2) on the folder itself: no lock file is left in the user's folder, and the kernel drops the lock
when the process ends, also on SIGKILL, so a killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from stack.errors import StackError

_held: dict[str, int] = {}
"""Folders this process holds (resolved path -> descriptor): taking one again is a no-op."""


def hold_folder(folder: Path, busy: str) -> None:
    """Create `folder` if needed and hold its writer lock for the rest of this process; a StackError with the
    message `busy` when another process holds it."""
    import fcntl

    key = str(Path(folder).resolve())
    if key in _held:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise StackError(busy) from None
    _held[key] = handle


def release_folder(folder: Path) -> None:
    """Give up the writer lock `hold_folder` took on `folder` (nothing when this process does not hold it)."""
    handle = _held.pop(str(Path(folder).resolve()), None)
    if handle is not None:
        os.close(handle)


def exchanged(a: Path, b: Path) -> None:
    """After folders `a` and `b` swapped places (`stack.durable.exchange`), the locks this process holds follow
    the directories, so they are filed under their new paths (the lock taken on `a` now guards `b`'s path)."""
    keys = str(Path(a).resolve()), str(Path(b).resolve())
    handles = [_held.pop(key, None) for key in keys]
    for key, handle in zip(reversed(keys), handles):
        if handle is not None:
            _held[key] = handle


@contextmanager
def folder_lock(folder: Path, busy: str):
    """`hold_folder` for the duration of a `with` block: a process that trains several runs in turn (a test
    session, a sweep) lets go of each folder when its run ends. A lock this process already held is kept."""
    held_before = str(Path(folder).resolve()) in _held
    hold_folder(folder, busy)
    try:
        yield
    finally:
        if not held_before:
            release_folder(folder)
