"""H.264 video as bytes: the encoder of clip shards (`stack.data.clips`) and of driving clips (`stack.sim.drive_clips`).

PyAV's bundled libx264, single-threaded with bit-exact flags and no B-frames, so the same frames give the
same bytes (clip shards stay byte-identical for a seed). Decoding on the CPU goes through PyAV too; on a GPU,
DALI's NVDEC decoder reads the same bytes (`stack.data.clips.decode_h264_gpu`).
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

H264_OPTIONS = {"crf": "18", "preset": "veryfast", "threads": "1", "bf": "0"}


def encode_h264(frames: np.ndarray, rate_hz: float) -> bytes:
    """MP4 bytes of uint8 RGB frames (T, H, W, 3)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(rate_hz).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = dict(H264_OPTIONS)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decode_h264(data: bytes) -> np.ndarray:
    """uint8 RGB frames (T, H, W, 3) of MP4 bytes, decoded on the CPU with PyAV."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
