"""Check every member a loader reads against the hash (xxh3_64) its shard's `.sums` file recorded.

A flipped bit inside a JPEG's entropy-coded data still decodes — as garbage pixels that
train the model on noise — so decoding is no check. `stack data make` records each
member's hash (`stack.data.format.member_hash`); both loaders compare the bytes they actually read
with it, and a mismatch is a `BadSample` naming the shard, the sample key and the member
(with `data.skip_bad_samples=true` it is counted and replaced like any bad sample).
"""

from __future__ import annotations

from pathlib import Path

from stack.data.format import CHECKSUM, member_hash
from stack.data.samples import BadSample
from stack.errors import StackError
from stack.safe_values import escaped


def sums_path(shard: str | Path) -> Path:
    return Path(shard).with_suffix(".sums")


def load_sums(shard: str | Path) -> dict:
    """{key: {member: hash}} of a shard; a missing or unreadable `.sums` file is a BadSample naming it."""
    from stack.user_json import read_json

    path = sums_path(shard)
    fix = "Every shard of this schema has one: re-create the dataset with `stack data make`."
    try:
        table = read_json(path, f"the checksum file of shard {escaped(str(shard))}", fix)
    except StackError as exc:
        raise BadSample(str(exc)) from None
    if table.get("algorithm") != CHECKSUM or not isinstance(table.get("samples"), dict):
        raise BadSample(f"{escaped(str(path))}: expected the checksum file of shard {escaped(str(shard))} (algorithm "
                        f"{CHECKSUM!r} and a 'samples' table); found the keys {escaped(str(sorted(table))[:200])}. {fix}")
    return table["samples"]


def verify(member: str, data, expected: dict, shard: str, key: str) -> None:
    """Raise BadSample unless the hash of `data` (bytes or a uint8 array) is what `expected[member]` recorded."""
    if member not in expected:
        raise BadSample(f"shard {shard}, sample {key}: member {member} has no checksum in {sums_path(shard)}; "
                        "the shard and its checksum file do not belong together: re-create them with `stack data make`")
    found = member_hash(data)
    if found != expected[member]:
        raise BadSample(f"shard {shard}, sample {key}: member {member} is corrupt ({CHECKSUM} {found:016x}, written "
                        f"as {expected[member]:016x}): its bytes changed after the shard was written (disk or copy error); "
                        "re-create the shard, or set data.skip_bad_samples=true to skip such samples")


class ShardSums:
    """The `.sums` tables of the shards a loader reads, loaded once per shard (per process)."""

    def __init__(self):
        self._tables: dict = {}

    def check_sample(self, sample: dict, shard: str) -> None:
        """Every member of a WebDataset sample dict (`__key__`, `member: bytes`)."""
        key = sample.get("__key__", "?")
        expected = self.expected(shard, key)
        for member, data in sample.items():
            if not member.startswith("__"):
                verify(member, data, expected, shard, key)

    def check_member(self, member: str, data, shard: str, key: str) -> None:
        verify(member, data, self.expected(shard, key), shard, key)

    def expected(self, shard: str, key: str) -> dict:
        if shard not in self._tables:
            self._tables[shard] = load_sums(shard)
        table = self._tables[shard].get(key)
        if table is None:
            raise BadSample(f"shard {shard}: sample {escaped(str(key))} is not listed in {sums_path(shard)}; the shard "
                            "and its checksum file do not belong together: re-create them with `stack data make`")
        if not isinstance(table, dict) or not all(isinstance(value, int) and not isinstance(value, bool)
                                                  for value in table.values()):
            raise BadSample(f"{sums_path(shard)}: sample {escaped(str(key))} should map each member to its {CHECKSUM} "
                            f"(an integer); found {escaped(str(table)[:120])}. Re-create the dataset with "
                            "`stack data make`.")
        return table
