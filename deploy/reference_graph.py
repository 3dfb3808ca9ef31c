"""A frozen reference network for a measured FPS bar: the recipe network's graph as it was when the bar was set.

A measured bar has to hold on whatever CPU runs it, idle or busy. The gate therefore times a reference workload
beside the candidate and scales the candidate's latency by (the reference's time on the machine the bar was set on)
/ (its time now). That works only if the reference speeds up and slows down like the network across instruction
sets: a dense fp32 matmul does not (it ran 4.4-4.8x slower on an AVX2-only EPYC than on the AVX-512 EPYC the old bar
was set on, the network about 2x, so a network made twice as slow passed:
docs/log/2026-11-26_reference-workload-fps-bar.md). The network itself as it was when the bar was set does, by
construction, and a change that slows today's network does not slow the frozen copy.

The frozen file keeps the graph, its integer tensors (shapes, gather indices of the BEV pooling) exactly, and for
each float tensor only its shape, mean and standard deviation: a dense fp32 graph costs the same whatever its
weights, the statistics keep the activations' magnitudes (no denormal slow paths), and the file stays small
(0.89 MB for the tiny network instead of 7.7 MB; 0.14 MB gzipped, as `freeze` writes a `.gz` path).
`thaw` rebuilds the weights from a fixed seed.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from pathlib import Path

import numpy as np

FLOAT_STATS_KEY = "stack.reference_graph.float_stats"
"""metadata_props key: JSON list of [name, dtype, shape, mean, std] of the float tensors that were dropped."""
FREEZE_SEED = 0


def freeze(onnx_path: str | Path, out_path: str | Path) -> Path:
    """Write `onnx_path`'s graph with every float initializer replaced by its statistics to `out_path`."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    kept, stats = [], []
    for tensor in model.graph.initializer:
        values = numpy_helper.to_array(tensor)
        if np.issubdtype(values.dtype, np.floating) and values.size > 1:
            stats.append([tensor.name, values.dtype.name, list(values.shape), float(values.mean()), float(values.std())])
        else:
            kept.append(tensor)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    entry = model.metadata_props.add()
    entry.key, entry.value = FLOAT_STATS_KEY, json.dumps(stats)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    data = model.SerializeToString()
    out_path.write_bytes(gzip.compress(data, mtime=0) if out_path.suffix == ".gz" else data)
    return out_path


def thaw(path: str | Path) -> bytes:
    """The serialized ONNX model of a frozen graph with its float tensors drawn again (normal, the stored mean
    and standard deviation, seed FREEZE_SEED): what an ONNX Runtime session loads."""
    import onnx
    from google.protobuf.message import DecodeError
    from onnx import numpy_helper

    from stack.errors import StackError
    from stack.safe_values import escaped
    from stack.user_json import parse_json

    again = "Write one with `stack bench fps-bar`, which freezes the pipeline's network."
    try:
        model = onnx.load_from_string(_graph_bytes(Path(path), again))
    except DecodeError as exc:
        raise StackError(f"{escaped(str(path))}: not an ONNX graph ({exc}). {again}") from None
    entries = {entry.key: entry.value for entry in model.metadata_props}
    if FLOAT_STATS_KEY not in entries:
        raise StackError(f"{path} is not a frozen reference graph (no {FLOAT_STATS_KEY} metadata): {again}")
    stats = parse_json(entries[FLOAT_STATS_KEY], escaped(str(path)), "a frozen reference graph's float statistics",
                       again, expect=list)
    rng = np.random.default_rng(FREEZE_SEED)
    elements = 0
    for entry in stats:
        name, dtype, shape, mean, std = _float_stat(entry, path, again)
        elements += math.prod(shape)
        if elements > MAX_THAWED_ELEMENTS:
            raise StackError(f"{escaped(str(path))}: its float tensors hold more than {MAX_THAWED_ELEMENTS:,} values "
                             f"(a network of {MAX_THAWED_ELEMENTS * 4 / 1024 ** 3:.0f} GiB in fp32). {again}")
        values = rng.normal(mean, std, size=shape).astype(dtype)
        model.graph.initializer.append(numpy_helper.from_array(values, name))
    return model.SerializeToString()


MAX_GRAPH_BYTES = 2 * 1024 ** 3
"""Largest frozen graph read, gzipped or decompressed: ONNX's protobuf limit; the tiny network's is 0.89 MB."""
MAX_THAWED_ELEMENTS = 2 ** 28
"""Most float values a thawed graph may hold (1 GiB in fp32, drawn in float64: 2 GiB at the peak; the tiny network
has 2 M): a frozen file's statistics say how many are drawn."""
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _graph_bytes(path: Path, again: str) -> bytes:
    """The serialized ONNX of a frozen file, gunzipped when it is gzip, at most MAX_GRAPH_BYTES either way (a
    small gzip can expand without bound)."""
    from stack.errors import StackError
    from stack.safe_values import escaped

    if not path.is_file() or path.stat().st_size > MAX_GRAPH_BYTES:
        raise StackError(f"{escaped(str(path))}: expected a frozen reference graph of at most "
                         f"{MAX_GRAPH_BYTES // 1024 ** 2:,} MiB; found {'no file' if not path.is_file() else 'more'}. "
                         f"{again}")
    with path.open("rb") as handle:
        if handle.read(2) != b"\x1f\x8b":
            return path.read_bytes()
    try:
        with gzip.open(path, "rb") as handle:
            data = handle.read(MAX_GRAPH_BYTES + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise StackError(f"{escaped(str(path))}: a gzip file that cannot be decompressed ({exc}). {again}") from None
    if len(data) > MAX_GRAPH_BYTES:
        raise StackError(f"{escaped(str(path))}: decompresses to more than {MAX_GRAPH_BYTES // 1024 ** 2:,} MiB; a "
                         f"frozen reference graph is a few MB. {again}")
    return data


def _float_stat(entry, path, again: str) -> tuple:
    """(name, dtype, shape, mean, std) of one float-statistics entry, each checked."""
    from stack.errors import StackError
    from stack.safe_values import escaped

    ok = (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], str) and entry[1] in FLOAT_DTYPES
          and isinstance(entry[2], list) and len(entry[2]) <= 8
          and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_THAWED_ELEMENTS for n in entry[2])
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)) for v in entry[3:])
          and entry[4] >= 0)
    if not ok:
        raise StackError(f"{escaped(str(path))}: a float-statistics entry is {escaped(str(entry)[:120])}; expected "
                         f"[name, float dtype, shape (at most 8 sizes), mean, std >= 0]. {again}")
    return tuple(entry)


def example_feeds(model_bytes: bytes) -> dict:
    """Inputs of the graph's declared shapes and types (camera bytes, ego status, command), seed FREEZE_SEED."""
    import onnx
    from onnx import helper

    model = onnx.load_from_string(model_bytes)
    rng, feeds = np.random.default_rng(FREEZE_SEED), {}
    initializers = {tensor.name for tensor in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        shape = [dim.dim_value or 1 for dim in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[value.name] = rng.integers(0, 2 if dtype == np.int64 else 255, size=shape).astype(dtype)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds
