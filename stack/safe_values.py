"""Rules for string values that end up in file names or in generated scripts.

A pipeline value is data, never code: a target name becomes a folder under
`export.out_dir`, SLURM keys become `#SBATCH` lines, paths are written into shell
scripts. The schema (`stack.pipeline` `problems()`) applies these rules so that a
value that could escape its folder or add a line to a script is refused before any
work starts; the writers still quote everything they write (`shlex.quote`).

Each check returns None when the value is fine, else what is wrong and what is
allowed, to go after the key in a `problems()` entry. Standard library only: the
schema imports this module.
"""

from __future__ import annotations

import re

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0 and C1 control characters and DEL: a newline ends a script line, an escape rewrites a terminal."""
IDENTIFIER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A name that is safe as one path component: no `/`, no `..` escape, no leading dot (hidden or relative)."""
SLURM_TIME = re.compile(r"([0-9]+-[0-9]+(:[0-9]+){0,2}|[0-9]+(:[0-9]+){0,2}|UNLIMITED|INFINITE)")
"""sbatch --time forms (sbatch(1)): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds; UNLIMITED/INFINITE ask for the partition's limit."""
SLURM_PARTITION = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
"""One partition name, or a comma-separated list of them (sbatch --partition)."""
SLURM_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:=@%+/~-]+)?")
"""A long sbatch option with an optional value: `--account=perception`, `--exclusive`, `--mem=64G`."""

SLURM_MEM = re.compile(r"[0-9]+[KMGT]?")
"""sbatch --mem: a count, megabytes unless a K/M/G/T suffix says otherwise; 0 asks for all of the node's memory."""
CONTAINER_MOUNT_PATH = re.compile(r"/[^,:]*")
"""A path on either side of a pyxis mount: absolute; `,` separates mounts and `:` source, target and flags."""
CONTAINER_MOUNT_FLAGS = re.compile(r"[a-z]+(\+[a-z]+)*")
"""pyxis/enroot mount flags: `ro`, `rw`, `rbind`, ... joined with `+` (`ro+rbind`)."""


def control_characters(value: str) -> str | None:
    """Control characters are refused in every string of the pipeline."""
    found = CONTROL.search(value)
    if found is None:
        return None
    return (f"got {_short(value)}, which holds the control character {found.group()!r} at position "
            f"{found.start()}; remove it (a newline or escape in a value would end or rewrite a script line)")


def identifier(value: str) -> str | None:
    """Target names (and other names used as one folder) must be identifiers."""
    if IDENTIFIER.fullmatch(value) and value not in (".", ".."):
        return None
    return (f"got {_short(value)}; a name is used as a folder, so it must be letters, digits, '_', '.' and '-' "
            f"only, and must not start with '.' (e.g. orin, x86-gpu, orin_nano.v2)")


def slurm_time(value: str) -> str | None:
    if SLURM_TIME.fullmatch(value):
        return None
    return (f"got {_short(value)}; expected an sbatch time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
            f"(e.g. 04:00:00, 2-00:00:00); quote it in YAML files ('12:00:00')")


def slurm_time_seconds(value: str) -> int | None:
    """Seconds in an sbatch --time value already checked by `slurm_time`; None for UNLIMITED/INFINITE."""
    if value in ("UNLIMITED", "INFINITE"):
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    hours, minutes, seconds = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]  # MM, MM:SS, H:M:S
    return (hours * 60 + minutes) * 60 + seconds


def slurm_partition(value: str) -> str | None:
    if value == "" or SLURM_PARTITION.fullmatch(value):
        return None
    return f"got {_short(value)}; expected a partition name (letters, digits, '_', '.', '-') or a comma-separated list"


def slurm_option(value: str) -> str | None:
    if SLURM_OPTION.fullmatch(value):
        return None
    return (f"got {_short(value)}; expected a long sbatch option `--name` or `--name=value` (value of letters, "
            f"digits and _.,:=@%+/~-, no spaces or quotes), e.g. --account=perception")


def slurm_mem(value: str) -> str | None:
    if value == "" or SLURM_MEM.fullmatch(value):
        return None
    return (f"got {_short(value)}; expected sbatch memory per node: a whole number with an optional K, M, G or T "
            f"suffix (megabytes without one), e.g. 256G or 64000; empty leaves it to the cluster")


def container_image(value: str) -> str | None:
    """A pyxis image: a registry reference (`nvcr.io#nvidia/pytorch:24.05-py3`) or a squashfs path; the
    script quotes it, so spaces and `;` are fine, but it must name something."""
    if value == "" or (value.strip() == value and not value.startswith("-")):
        return None
    return (f"got {_short(value)}; expected an image reference (e.g. nvcr.io#nvidia/pytorch:24.05-py3) or a "
            f".sqsh path, without leading or trailing spaces or a leading '-'")


def container_mount(value: str) -> str | None:
    """One pyxis `--container-mounts` entry, `SRC[:DST[:FLAGS]]`: pyxis splits the option at `,` and each entry
    at `:`, so a path holding either would become another mount, which quoting cannot prevent."""
    parts = value.split(":")
    if (len(parts) <= 3 and all(CONTAINER_MOUNT_PATH.fullmatch(p) for p in parts[:2])
            and (len(parts) < 3 or CONTAINER_MOUNT_FLAGS.fullmatch(parts[2]))):
        return None
    return (f"got {_short(value)}; expected SRC[:DST[:FLAGS]] with absolute paths that hold no ',' or ':' "
            f"(pyxis splits mounts there) and flags such as ro, e.g. /data:/data:ro")


def _short(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def escaped(text: str, limit: int = 200) -> str:
    """`text` as it may be printed: control characters as `\\x1b`-style escapes (a name from a user's file must
    not move the cursor or recolour the terminal), cut at `limit` characters."""
    text = str(text)
    shown = CONTROL.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text[:limit])
    return shown + ("..." if len(text) > limit else "")
