"""The previous key frame of a sample, and the ego motion since it: what a temporal network (BEVDet4D) fuses.

Every frame sample's key ends in its frame index within its sequence (`s{scene}f{frame}` for recorded
scenes, `d{episode}f{frame}` for closed-loop episodes, `i{iteration}e{episode}f{frame}` for DAgger's), and
the writers store a sequence's frames one after another, so the previous key frame of the sample at
(shard, index) is the sample before it: in the same shard, or the last of the shard before it in the
split. `previous_location` finds it and checks its key; a sequence's first frame has none, and then
the network is given the frame itself with zero motion, as BEVDet4D does at a sequence start. A clip
shard holds a whole recorded scene's key frames in order, so there the previous key frame is the clip's
frame before (`stack.data.loader.add_clip_history`).

Key frames are 0.5 s apart (2 Hz: recorded scenes and the replanning instants of the closed loop alike;
`stack.pipeline.temporal_problems` refuses other rates), which is the spacing of the stored past
trajectory, so the previous ego pose comes from the sample's own labels (`previous_pose`) and no
schema change is needed.
"""

from __future__ import annotations

import re

_FRAME = re.compile(r"^(?P<sequence>.+f)(?P<frame>\d{4})$")


def sequence_of(key: str) -> str:
    """The sequence (recorded scene or closed-loop episode) a sample key belongs to: the key without its frame
    index; a key that names no frame is a sequence of its own. Frames of one sequence are correlated, so
    statistics over held-out frames resample whole sequences (`stack.deploy.gates.accuracy`)."""
    match = _FRAME.match(key)
    return match["sequence"][:-1] if match else key


def split_sequences(pipeline, split: str) -> list[str]:
    """The sequence of every frame of `split` in its unshuffled order (the order `read_split` counts in), from the
    shards' tar headers: a frame sample's key names it; a clip sample (key `s{scene}`) is a whole scene, whose
    frames_per_clip frames all belong to it."""
    from stack.data.loader import read_manifest, split_shards
    from stack.data.shard_index import scan

    root = pipeline.data.root
    manifest = read_manifest(root)
    frames = manifest.get("frames_per_clip", 1) if manifest.get("layout") == "clips" else 1
    return [sequence_of(key) for shard, _ in split_shards(manifest, root, split) for key, _ in scan(shard)
            for _ in range(frames)]


def previous_key(key: str) -> str | None:
    """The key of the frame before `key` in its sequence; None for a first frame or a key without a frame index."""
    match = _FRAME.match(key)
    if not match or int(match["frame"]) == 0:
        return None
    return f"{match['sequence']}{int(match['frame']) - 1:04d}"


def previous_location(shards: list, reader, shard: str, index: int, key: str) -> tuple | None:
    """(shard, index) of the previous key frame of sample `key` at (shard, index) in the split's `shards`
    [(path, samples)], read through `reader` (a SampleReader's index); None where the sequence starts here."""
    wanted = previous_key(key)
    if wanted is None:
        return None
    if index > 0:
        candidate = (shard, index - 1)
    else:
        paths = [path for path, _ in shards]
        position = paths.index(shard) if shard in paths else 0
        if position == 0:
            return None
        before = paths[position - 1]
        candidate = (before, len(reader.index(before)) - 1)
    found_key = reader.index(candidate[0])[candidate[1]][0]
    return candidate if found_key == wanted else None
