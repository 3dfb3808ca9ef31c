"""The stateful graph of a temporal network (model.temporal_frames=k): its extra inputs and output, and feeds.

A temporal network fuses the view transform's BEVs of the k key frames before it, 0.5 s apart (BEVDet4D,
`stack.models.temporal`). Exported, that memory becomes an input and an output of the graph, so a runtime
carries it from one frame to the next (`stack.deploy.runner.DeployedNetwork`) and the graph stays one frame's
work. The memory is the k newest frames' BEVs before fusion, not a running state: fusing frame t needs frames
t-1 ... t-k only, so k + 1 frames score frame t exactly as a whole sequence would (`with_memory`).
No torch here: a runtime imports this module.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

STATE_INPUTS = ("previous_bev", "previous_pose", "previous_valid")
"""The further inputs of a stateful graph, after images/ego_status/command: the `bev_memory` output of the key
frame KEY_FRAME_PERIOD_S earlier, the ego pose then in the current ego frame (x, y, yaw), and per sample 1 where
that memory is given or 0 at a sequence start (the frame is then fused with itself, as in training)."""
MEMORY_OUTPUT = "bev_memory"
"""A stateful graph's last output: this frame's BEV memory, the next key frame's `previous_bev`."""
KEY_FRAME_PERIOD_S = 0.5
"""The time between a frame and the one whose memory it fuses (stack.data.sequences: key frames at 2 Hz)."""
PREVIOUS_IMAGES = "previous_images"
"""Not a graph input: a feed that carries the previous key frame's images instead of its memory (`with_memory`)."""
EARLIER_IMAGES, EARLIER_POSES = "earlier_images", "earlier_poses"
"""Not graph inputs: for a network fusing k >= 2 key frames, the k - 1 frames before the previous one (newest first,
N cameras each: (B, (k - 1) N, 3, H, W)) and each one's ego pose in the frame of the key frame after it
((B, k - 1, 3)), which the previous frame's memory is built from (`with_memory`)."""


def with_memory(feeds: dict, run: Callable[[dict], dict], memory_shape: tuple) -> dict:
    """Graph feeds for one frame of a stateful graph. A feed with PREVIOUS_IMAGES (and previous_pose; for k >= 2
    also EARLIER_IMAGES and EARLIER_POSES) gets its previous_bev by `run` on those frames first, oldest first, each
    fed the memory of the one before it, as the graph carries it on the road: `run(feeds) -> {output name: array}`
    is the graph being judged (or the PyTorch network it came from), so each runs on its own memory. The memory of
    the oldest frame is a sequence start's; the k - 1 copies a start repeats are pushed out before they reach the
    frame scored, so k + 1 frames score it exactly as a whole sequence would. The earlier frames' ego status and
    command do not reach the memory (it is the BEV before the heads). `memory_shape`: the graph's previous_bev
    shape (zeros are fed where the start of a sequence ignores it)."""
    if PREVIOUS_IMAGES not in feeds:
        return feeds
    previous = feeds[PREVIOUS_IMAGES]
    batch, cameras = previous.shape[:2]
    frames, poses = [previous], []
    if EARLIER_IMAGES in feeds:
        earlier = feeds[EARLIER_IMAGES]
        frames += [earlier[:, i:i + cameras] for i in range(0, earlier.shape[1], cameras)]
        poses = [feeds[EARLIER_POSES][:, i] for i in range(feeds[EARLIER_POSES].shape[1])]
    base = {"ego_status": feeds["ego_status"], "command": feeds["command"]}
    memory = np.asarray(run({**base, "images": frames[-1], STATE_INPUTS[0]: np.zeros(memory_shape, np.float32),
                             STATE_INPUTS[1]: np.zeros((batch, 3), np.float32),
                             STATE_INPUTS[2]: np.zeros((batch,), np.float32)})[MEMORY_OUTPUT], np.float32)
    for frame, pose in zip(reversed(frames[:-1]), reversed(poses)):
        memory = np.asarray(run({**base, "images": frame, STATE_INPUTS[0]: memory,
                                 STATE_INPUTS[1]: np.asarray(pose, np.float32),
                                 STATE_INPUTS[2]: np.ones((batch,), np.float32)})[MEMORY_OUTPUT], np.float32)
    concrete = {k: v for k, v in feeds.items() if k not in (PREVIOUS_IMAGES, EARLIER_IMAGES, EARLIER_POSES)}
    concrete.update({STATE_INPUTS[0]: memory, STATE_INPUTS[2]: np.ones((batch,), np.float32)})
    return concrete


def memory_shape(session) -> tuple | None:
    """The previous_bev shape of an ONNX Runtime session's graph (dynamic axes as 1), or None: not stateful."""
    for spec in session.get_inputs():
        if spec.name == STATE_INPUTS[0]:
            return tuple(d if isinstance(d, int) else 1 for d in spec.shape)
    return None


def resolving(run: Callable[[dict], dict], shape: tuple | None) -> Callable[[dict], dict]:
    """`run` that first resolves a feed's PREVIOUS_IMAGES with itself (`with_memory`); `run` itself where the graph
    is not stateful (`shape` None)."""
    if shape is None:
        return run
    return lambda feeds: run(with_memory(feeds, run, shape))
