"""Changes to folders that a kill, a power cut or a full disk cannot leave half done.

A dataset (`stack data make`) and a deploy bundle (`stack deploy`) are built aside and put in place whole,
so a reader never sees half of one and half of the other:

- `exchange(a, b)` swaps two directory entries in one step: Linux's `renameat2(RENAME_EXCHANGE)` (rename(2)
  cannot replace a non-empty directory); False where the C library or the file system lacks it, so the
  caller can fall back to renames.
- `write_atomic(path, data)`: a file written whole or not at all (a temp file beside it, then a rename), for
  reports and records that a reader may open while they are written. The temp file's name carries the writer's
  host and PID (`temporary_name`), so the next write of the same file removes what a killed writer on this host
  left (`clear_dead_writers`) and never touches a live writer's, nor one from another host sharing the folder.
- `fsync_tree` / `fsync_dir` / `write_durably`: a rename is durable only once the folder holding it is
  fsync'd, and the renamed files only once their own data is (POSIX; ext4's delayed allocation shows it).
- `disk_full(folder, kept)`: a full disk (ENOSPC, EDQUOT) or a file-size limit (EFBIG, `ulimit -f`) while
  writing under `folder` becomes one line naming the folder (and the file, when the OS says which) and
  what was kept, instead of a traceback from deep inside a writer.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from stack.errors import StackError

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
FULL = {errno.ENOSPC: "the file system is full", errno.EDQUOT: "the disk quota is used up",
        errno.EFBIG: "a file reached the size limit for files (ulimit -f)"}
"""The errors that mean "no room to write", with what each says."""


def exchange(a: Path, b: Path) -> bool:
    """renameat2(a, b, RENAME_EXCHANGE); False where the C library or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not supported here: fall back to two renames
        return False
    raise OSError(error, os.strerror(error), str(b))


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable: POSIX needs an fsync of the folder itself."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, then `folder` itself (before it is renamed into place)."""
    for parent, folders, files in os.walk(folder, topdown=False):
        for name in files:
            descriptor = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        fsync_dir(Path(parent))


def _host() -> str:
    """This machine's name as a temp file carries it: letters, digits and '-' only (a '.' would split it)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def temporary_name(name: str) -> str:
    """The temp file `write_atomic` writes `name` through: `.NAME.HOST.PID.tmp`."""
    return f".{name}.{_host()}.{os.getpid()}.tmp"


def leftover_pattern(names: str) -> re.Pattern:
    """The temp files `write_atomic` writes the files matching the regex `names` through."""
    return re.compile(rf"\.(?P<name>{names})\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>[0-9]+)\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or a PID out of range: not known dead, so kept
    return True


def clear_dead_writers(path: Path) -> list[Path]:
    """Remove the temp files of `path` whose writer ran on this host and is gone (SIGKILL, power cut before the
    rename); returns them. A live writer's, another host's (a shared file system) and a file that is not a plain
    file are left."""
    path, here, removed = Path(path), _host(), []
    pattern = leftover_pattern(re.escape(path.name))
    try:
        candidates = list(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))
    except OSError:
        return removed
    for candidate in candidates:
        found = pattern.fullmatch(candidate.name)
        if not found or found["host"] != here or _alive(int(found["pid"])) or candidate.is_symlink() \
                or not candidate.is_file():
            continue
        try:
            candidate.unlink(missing_ok=True)
        except OSError:  # not ours to remove (another user's folder): the write itself goes on
            continue
        removed.append(candidate)
    return removed


def write_atomic(path: Path, data: bytes | None = None, writer=None) -> Path:
    """Write `path` whole or not at all: into a temp file beside it (umask permissions, unlike mkstemp's 0600),
    then os.replace. `writer(temp_path)` writes the temp file when `data` is None (matplotlib's savefig). What a
    killed writer of the same file on this host left is removed first (`clear_dead_writers`)."""
    path = Path(path)
    clear_dead_writers(path)
    temporary = path.with_name(temporary_name(path.name))
    try:
        if data is not None:
            temporary.write_bytes(data)
        else:
            writer(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to a new file at `path` and fsync it. What was at `path` is unlinked first, never written
    through: a second link of someone's file there (a staging folder holds links of the user's files) keeps its
    content."""
    Path(path).unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with open(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


class DiskFull(StackError):
    """No room to write (full disk, quota, file-size limit); the message names the folder and what was kept."""


@contextmanager
def disk_full(folder: Path, kept: str | Callable[[], str], remove: Path | None = None):
    """Turn ENOSPC/EDQUOT/EFBIG raised inside the block into `DiskFull` naming `folder` (and the file when the
    OS names it: a link's or a rename's target, which is what needed the room), the free space left there and
    `kept` (what is intact; a callable when that depends on how far the block got, called after `remove`);
    `remove` (the partial output) is deleted first, so the space it took is given back."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
        file = exc.filename2 or exc.filename
        where = f" ({file})" if file else ""
        raise DiskFull(f"no room to write under {str(folder)!r}{where}: {FULL[exc.errno]}, {_free(folder)}. "
                       f"{kept() if callable(kept) else kept}. Free some space (or raise the limit) and run again") \
            from None


def _free(folder: Path) -> str:
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free there"
    return "free space unknown"
