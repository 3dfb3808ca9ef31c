"""Where the time goes on ONNX Runtime: per-node latency from its built-in profiler.

The measured counterpart of the latency model's per-layer table: a session with
`enable_profiling` runs the model a few times, and the node events of the trace
(https://onnxruntime.ai/docs/performance/tune-performance/profiling-tools.html) are
summed per node and averaged per run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def profile_nodes(path: str | Path, feeds: dict, runs: int = 10) -> list[tuple[str, str, float]]:
    """(node name, op type, mean ms per run), slowest first."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.intra_op_num_threads = os.cpu_count() or 1
    options.log_severity_level = 3
    options.profile_file_prefix = str(Path(path).with_suffix("")) + ".profile"
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)  # warm-up, excluded below by averaging over the timed runs only
    for _ in range(runs):
        session.run(None, feeds)
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink(missing_ok=True)
    totals: dict = {}
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        name = event["name"][: -len("_kernel_time")]
        op = event.get("args", {}).get("op_name", "")
        key = (name, op)
        totals[key] = totals.get(key, 0.0) + event.get("dur", 0) / 1e3
    rows = [(name, op, total / (runs + 1)) for (name, op), total in totals.items()]
    return sorted(rows, key=lambda row: -row[2])
