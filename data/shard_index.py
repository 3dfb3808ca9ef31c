"""Random access into tar shards: read one sample's members by their byte offsets.

A global shuffle (`stack.data.sharding`) visits samples in any order, so a loader
cannot stream a shard front to back. `SampleReader` lists each shard's tar headers
once (Python's `tarfile`, which seeks over the data, so a shard of a few hundred
members is indexed in milliseconds) and then reads a sample's members with one
`os.pread` each. The index comes from the tar itself rather than the `.idx` file
beside it, so a shard rewritten without its index is still read correctly, and a
truncated or unreadable shard fails with its path named. Reads come from the page
cache once a shard has been read: then any order costs the same as stored order
(`stack bench data` measures both).
"""

from __future__ import annotations

import os
import tarfile

from stack.data.samples import BadSample


class ShortShard(BadSample):
    """A shard that holds fewer samples than asked for."""

    def __init__(self, samples: int, message: str):
        super().__init__(message)
        self.samples = samples


def scan(shard: str) -> list:
    """[(key, {member: (offset, size)})] of a shard in stored order; an unreadable tar is a BadSample naming it."""
    samples: list = []
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                key, _, member = info.name.rpartition("/")[2].partition(".")
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                samples[-1][1][member] = (info.offset_data, info.size)
    except (tarfile.TarError, OSError, ValueError) as exc:
        where = f"after sample {samples[-1][0]}" if samples else "at its start"
        raise BadSample(f"shard {shard}: not a readable tar ({exc}) {where}; re-create it with `stack data make`") from exc
    return samples


class SampleReader:
    """Reads samples by (shard, index): `{"__key__": key, member: bytes, ...}`, like a WebDataset sample dict."""

    def __init__(self):
        self._index: dict = {}
        self._failed: dict = {}
        self._files: dict = {}

    def prepare(self, shards: list) -> None:
        """Index `shards` [(path, samples)] now, remembering the error of any that cannot be read (raised again
        when one of its samples is read). A loader calls this once, before its worker processes fork, so they
        inherit the index instead of re-scanning every shard every epoch."""
        for shard, _ in shards:
            try:
                self.index(shard)
            except BadSample as exc:
                self._failed[shard] = exc

    def read(self, shard: str, index: int) -> dict:
        samples = self.index(shard)
        if index >= len(samples):
            raise ShortShard(len(samples), f"shard {shard}: holds {len(samples)} samples, the manifest promises at least "
                             f"{index + 1}; the shard is truncated or was replaced; re-create the dataset with "
                             "`stack data make`")
        key, members = samples[index]
        sample = {"__key__": key}
        descriptor = self._descriptor(shard)
        for member, (offset, size) in members.items():
            data = os.pread(descriptor, size, offset)
            if len(data) != size:
                raise BadSample(f"shard {shard}, sample {key}: member {member} is cut short ({len(data)} of {size} "
                                "bytes); the shard was truncated after it was indexed; re-create it with `stack data make`")
            sample[member] = data
        return sample

    def index(self, shard: str) -> list:
        if shard in self._failed:
            raise self._failed[shard]
        if shard not in self._index:
            self._index[shard] = scan(shard)
        return self._index[shard]

    def _descriptor(self, shard: str) -> int:
        if shard not in self._files:
            try:
                self._files[shard] = os.open(shard, os.O_RDONLY)
            except OSError as exc:
                raise BadSample(f"shard {shard}: cannot be opened ({exc}); re-create the dataset with "
                                "`stack data make`") from exc
        return self._files[shard]

    def close(self) -> None:
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()

    def __del__(self):
        self.close()
