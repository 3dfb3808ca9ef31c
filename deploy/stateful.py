"""The stateful graph of a temporal network (model.temporal_frames=1): its extra inputs and output, and feeds.

A temporal network fuses the view transform's BEV of the key frame 0.5 s earlier (BEVDet4D,
`stack.models.temporal`). Exported, that memory becomes an input and an output of the graph, so a runtime
carries it from one frame to the next (`stack.deploy.runner.DeployedNetwork`) and the graph stays one frame's
work. The memory is the frame's BEV before fusion, not a running state: fusing frame t needs frame t-1's
memory only, so a pair of frames scores frame t exactly as a whole sequence would (`with_memory`).
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


def with_memory(feeds: dict, run: Callable[[dict], dict], memory_shape: tuple) -> dict:
    """Graph feeds for one frame of a stateful graph. A feed with PREVIOUS_IMAGES (and previous_pose) gets its
    previous_bev by `run` on those images first: `run(feeds) -> {output name: array}` is the graph being judged
    (or the PyTorch network it came from), so each runs on its own memory, as it would on the road. The previous
    frame's ego status and command do not reach the memory (it is the BEV before the heads). `memory_shape`: the
    graph's previous_bev shape (zeros are fed where the start of a sequence ignores it)."""
    if PREVIOUS_IMAGES not in feeds:
        return feeds
    previous = feeds[PREVIOUS_IMAGES]
    batch = previous.shape[0]
    start = {"images": previous, "ego_status": feeds["ego_status"], "command": feeds["command"],
             STATE_INPUTS[0]: np.zeros(memory_shape, np.float32), STATE_INPUTS[1]: np.zeros((batch, 3), np.float32),
             STATE_INPUTS[2]: np.zeros((batch,), np.float32)}
    memory = np.asarray(run(start)[MEMORY_OUTPUT], np.float32)
    concrete = {k: v for k, v in feeds.items() if k != PREVIOUS_IMAGES}
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
