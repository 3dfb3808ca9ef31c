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


class VideoMismatch(ValueError):
    """A video that is not the one expected (`about`: "codec", "size" or "frames"): found from what its container
    declares before decoding, or from a decoded frame before it is converted."""

    def __init__(self, about: str, message: str):
        super().__init__(message)
        self.about = about


def decode_h264(data: bytes, frames: int | None = None, size: tuple[int, int] | None = None) -> np.ndarray:
    """uint8 RGB frames (T, H, W, 3) of MP4 bytes, decoded on the CPU with PyAV.

    With `frames` (the count expected) and `size` ((height, width)), a VideoMismatch is raised before anything is
    decoded when the container declares another codec than H.264, another size or frame count, and while decoding
    at the first frame of another size or past `frames`: a small file declaring 8192x8192 frames, or thousands of
    them, is not decoded to find out (a decompression bomb). PyAV's own errors (av.error.*) pass through."""
    import av

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise VideoMismatch("codec", "holds no video stream, expected H.264")
        stream = container.streams.video[0]
        declared = (stream.codec_context.height, stream.codec_context.width)
        if frames is not None or size is not None:
            if stream.codec_context.name != "h264":
                raise VideoMismatch("codec", f"is {stream.codec_context.name} video, expected H.264")
            if size is not None and declared != tuple(size):
                raise VideoMismatch("size", f"is {declared[1]}x{declared[0]} pixels, expected {size[1]}x{size[0]}")
            if frames is not None and stream.frames and stream.frames != frames:
                raise VideoMismatch("frames", f"declares {stream.frames} frames, expected {frames}")
        decoded = []
        for frame in container.decode(stream):
            if size is not None and (frame.height, frame.width) != tuple(size):
                raise VideoMismatch("size", f"frame {len(decoded)} is {frame.width}x{frame.height} pixels, expected "
                                    f"{size[1]}x{size[0]}")
            if frames is not None and len(decoded) == frames:
                raise VideoMismatch("frames", f"holds more than {frames} frames, expected {frames}")
            decoded.append(frame.to_ndarray(format="rgb24"))
        if frames is not None and len(decoded) != frames:
            raise VideoMismatch("frames", f"holds {len(decoded)} frames, expected {frames}")
        return np.stack(decoded) if decoded else np.zeros((0, *declared, 3), np.uint8)
