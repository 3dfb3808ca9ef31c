"""Frames of `stack drive` clips side by side in one PNG, for pages that cannot play an MP4 (docs/log entries).

Each clip (front camera | BEV with the route, the boxes and the active plan; `stack.sim.drive_clips`) becomes one
column of its frames at the given times, scaled down; the columns stand side by side, in the order given.

    python benchmarks/clip_sheet.py runs/tiny-drive/drive-112/clips/A.mp4 runs/.../B.mp4 \
        --seconds 1,3,5,7 --out benchmarks/plots/closed-loop-best.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def frames_at(path: Path, seconds: list[float]) -> list[np.ndarray]:
    """RGB frames of the clip at `path` nearest each time in `seconds` (the clip's own frame rate)."""
    import av

    from stack.video import decode_h264

    with av.open(str(path)) as container:
        rate = float(container.streams.video[0].average_rate)
    decoded = decode_h264(path.read_bytes())
    wanted = [min(round(s * rate), len(decoded) - 1) for s in seconds]
    return [decoded[i] for i in wanted]


def sheet(paths: list[Path], seconds: list[float], scale: float) -> np.ndarray:
    """(H, W, 3) uint8: one column per clip, its frames top to bottom, scaled by `scale`."""
    from PIL import Image

    columns = []
    for path in paths:
        frames = [Image.fromarray(f) for f in frames_at(path, seconds)]
        size = (round(frames[0].width * scale), round(frames[0].height * scale))
        columns.append(np.concatenate([np.asarray(f.resize(size, Image.LANCZOS)) for f in frames], axis=0))
    height = max(c.shape[0] for c in columns)
    padded = [np.pad(c, ((0, height - c.shape[0]), (0, 0), (0, 0))) for c in columns]
    return np.concatenate(padded, axis=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clips", nargs="+", type=Path, help="MP4 clips written by stack drive")
    parser.add_argument("--seconds", default="1,3,5,7", help="times in the episode, comma-separated (default 1,3,5,7)")
    parser.add_argument("--scale", type=float, default=0.5, help="frame scale (default 0.5)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.clips if not p.is_file()]
    try:
        seconds = [float(s) for s in args.seconds.split(",") if s.strip()]
    except ValueError:
        seconds = []
    if missing or not seconds or min(seconds) < 0 or not 0 < args.scale <= 1:
        print(f"clip_sheet: expected existing MP4 clips, times >= 0 (e.g. 1,3,5,7) and a scale in (0, 1]; got missing "
              f"{missing or 'none'}, times {args.seconds!r}, scale {args.scale}; fix the arguments", file=sys.stderr)
        return 2
    from PIL import Image

    args.out.parent.mkdir(parents=True, exist_ok=True)
    picture = Image.fromarray(sheet(args.clips, seconds, args.scale))  # a 256-colour palette: a third of the bytes
    picture.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(args.out, optimize=True)
    print(f"wrote {args.out} ({len(args.clips)} clips x {len(seconds)} frames)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
