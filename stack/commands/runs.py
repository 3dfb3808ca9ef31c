"""`stack runs`: the tracked runs side by side; `stack runs compare A B`: what differs between two.

    stack runs -c configs/pipeline.yaml -c configs/presets/tiny.yaml     # the store beside runs/tiny/train
    stack runs train.tracking_uri=http://mlflow.internal:5000            # a tracking server
    stack runs compare 3f2a9c1b e07d4415 -c ...                           # run ids, unique id prefixes or run names

The store is the one `stack train` logs to under the same pipeline (`train.tracking_uri`; by
default the SQLite file `mlruns.db` beside train.out_dir). The list has one row per run, newest
first: run, start date, status, pipeline and data hashes, steps, final training and validation
loss, the eval headline metrics and verdict (`stack eval` logs them into the run), and each
deploy target's verdict. `compare` prints the pipeline keys whose values differ, the two
datasets, the code and host, and every metric of either run with the change. The same store
opens in MLflow's UI: `mlflow ui --backend-store-uri sqlite:///runs/tiny/mlruns.db`.
Exit 0; 2 for a missing store, an unknown or ambiguous run, or other words than `compare A B`.

The store is data from whoever wrote it, and SQLite keeps any type in any column: a metric whose value is not a
number (text, bytes) is shown as "not a number", with a line naming the run, the metric and what the store holds;
a start time that is not one as "not a date"; every name and value is printed escaped (`stack.safe_values`).
"""

from __future__ import annotations

import argparse
import time

from stack.safe_values import escaped

EVAL_COLUMNS = (("L2@3s", "eval/planning/L2_at_3s"), ("mAP", "eval/detection/mAP"),
                ("mIoU", "eval/segmentation/mIoU"), ("AbsRel", "eval/depth/AbsRel"))
"""(column, metric) of the eval headline figures in the list."""
COMPARED_TAGS = (("data", "stack.data_root"), ("data hash", "stack.data_hash"), ("pipeline hash", "stack.pipeline_hash"),
                 ("git commit", "stack.git_commit"), ("uncommitted changes", "stack.git_dirty"),
                 ("host", "stack.host"), ("devices", "stack.devices"), ("precision", "stack.precision"),
                 ("steps", "stack.steps"), ("eval verdict", "stack.eval.verdict"), ("eval data hash", "stack.eval.data_hash"))
NOT_A_NUMBER = "not a number"
"""How a metric value the store holds as something else (text, bytes) is shown."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `compare A B` arrive through the shared `key=value` positional, as `stack data`'s action does.
    parser.usage = "stack runs [-c FILE ...] [key=value ...]  |  stack runs compare A B [-c FILE ...] [key=value ...]"
    parser.epilog = ("A, B: run ids, unique id prefixes or run names. The store is train.tracking_uri's (default: "
                     "mlruns.db beside train.out_dir).")


def run(args: argparse.Namespace) -> int:
    from stack.cli import load_pipeline_from_args
    from stack.errors import StackError

    words = [word for word in args.overrides if "=" not in word]
    args.overrides = [word for word in args.overrides if "=" in word]
    if words and not (words[0] == "compare" and len(words) == 3):
        raise StackError(f"expected nothing (list the runs) or `compare A B` after `stack runs`, found {words!r}. "
                         f"Example: stack runs compare 3f2a9c1b e07d4415 -c configs/pipeline.yaml")
    pipeline = load_pipeline_from_args(args)
    client, uri = open_store(pipeline)
    if words:
        first, second = (find_run(client, word, uri) for word in words[1:])
        print(compare(first, second, client))
    else:
        print(listing(client, uri))
    return 0


def open_store(pipeline):
    """(MlflowClient, URI) of the pipeline's tracking store; StackError when tracking is off, or the store is missing
    or not an MLflow store this MLflow reads unchanged (`stack.lineage.store_problem`)."""
    from stack.errors import StackError
    from stack.lineage import quiet_mlflow, reachable, store_problem
    from stack.train.tracking import local_store_path, tracking_store_uri

    uri = tracking_store_uri(pipeline.train)
    if uri is None:
        raise StackError("train.tracking_uri is off, so there is no store to list. Give the store: "
                         "train.tracking_uri=runs/tiny/mlruns.db (or a server URI).")
    path = local_store_path(uri)
    if path is not None and not path.is_file():
        raise StackError(f"no MLflow store at {path}: no run has been tracked there. `stack train` with this pipeline "
                         f"creates it (train.out_dir={pipeline.train.out_dir}); or give the store with "
                         f"-c (the configs the runs trained with) or train.tracking_uri=PATH_OR_URI.")
    problem = store_problem(path) if path is not None else None  # MLflow would add its tables, or migrate it
    if problem:
        raise StackError(f"{problem}; `stack runs` only reads stores and leaves the file as it is. Give "
                         f"the store `stack train` wrote (train.tracking_uri=PATH_OR_URI).")
    why = reachable(uri)
    if why is not None:
        raise StackError(f"the MLflow tracking server {uri} is unreachable ({why}). Start it, or give another "
                         f"store with train.tracking_uri=...")
    quiet_mlflow()
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - sqlalchemy/MLflow raise many kinds for a store they cannot read
        raise StackError(f"{uri} is not an MLflow store this MLflow can read ({type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0][:200]}). Give the store `stack train` wrote "
                         f"(train.tracking_uri=PATH_OR_URI).") from None
    return client, uri


def all_runs(client) -> list:
    """Every run of every experiment in the store, newest first."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    return list(client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=5000))


def find_run(client, word: str, uri: str):
    """The run `word` names: a run id, a unique prefix of one, or a unique run name; StackError otherwise."""
    from stack.errors import StackError

    runs = all_runs(client)
    matches = [r for r in runs if r.info.run_id == word] or \
              [r for r in runs if r.info.run_id.startswith(word) and len(word) >= 4] or \
              [r for r in runs if r.info.run_name == word]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        known = printable(", ".join(f"{r.info.run_id[:8]} ({r.info.run_name})" for r in runs[:8]) or "none")
        raise StackError(f"no run {word!r} in {uri} (a run id, an id prefix of 4+ characters, or a run name). "
                         f"Runs there, newest first: {known}. `stack runs` lists them all.")
    raise StackError(f"{word!r} names {len(matches)} runs in {uri}: "
                     + printable(", ".join(f"{r.info.run_id[:12]} ({r.info.run_name})" for r in matches[:8]))
                     + ". Give more of the run id.")


def listing(client, uri: str) -> str:
    """The runs of the store as a markdown table, newest first."""
    runs = all_runs(client)
    header = ["run", "name", "started (UTC)", "status", "pipeline", "data", "steps", "loss", "val loss",
              *(name for name, _ in EVAL_COLUMNS), "eval", "deploy"]
    lines, notes = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)], []
    for r in runs:
        tags = r.data.tags
        deploys = " ".join(f"{k.removeprefix('stack.deploy.')}:{v}" for k, v in sorted(tags.items())
                           if k.startswith("stack.deploy."))
        metrics = [_number(_metric(r, key, notes)) for key in ("loss", "val/loss_total", *(k for _, k in EVAL_COLUMNS))]
        row = [r.info.run_id[:8], r.info.run_name or "", _date(r.info.start_time), r.info.status,
               _tag(tags, "stack.pipeline_hash")[:8], _tag(tags, "stack.data_hash")[:8], _tag(tags, "stack.steps"),
               *metrics, _tag(tags, "stack.eval.verdict"), deploys]
        lines.append("| " + " | ".join(printable(cell) for cell in row) + " |")
    lines.append(f"{len(runs)} runs in {uri}; `stack runs compare A B` shows what differs; the same store in "
                 f"MLflow's UI: mlflow ui --backend-store-uri {uri}")
    return "\n".join(lines + [printable(note) for note in notes])


def compare(a, b, client) -> str:
    """What differs between runs `a` and `b`: pipeline keys, data and code, and every metric.

    Each metric's change is printed without a verdict: a tracked run holds one last value per metric, no samples,
    so there is nothing to test. `stack bench compare` (unpaired timing samples: a rank test on medians) and
    `stack drive --compare` (the same episodes driven twice: a paired bootstrap) judge because they have samples."""
    out = [printable(f"{side}: {r.info.run_id} ({r.info.run_name}, {_date(r.info.start_time)}, {r.info.status})")
           for side, r in (("A", a), ("B", b))] + [""]
    keys = sorted(set(a.data.params) | set(b.data.params))
    differ = [(k, a.data.params.get(k, "-"), b.data.params.get(k, "-")) for k in keys
              if a.data.params.get(k) != b.data.params.get(k)]
    out += [f"pipeline keys that differ ({len(differ)} of {len(keys)}):"] + _table(["key", "A", "B"], differ)
    tags = [(name, a.data.tags.get(key, "-"), b.data.tags.get(key, "-")) for name, key in COMPARED_TAGS]
    same_data = a.data.tags.get("stack.data_hash") == b.data.tags.get("stack.data_hash")
    out += ["", "data, code and where it ran" + (" (same data)" if same_data else " (DIFFERENT data)") + ":"]
    out += _table(["", "A", "B"], [(n, x, y) for n, x, y in tags if n != "steps" or x != y or x != "-"])
    deploys = sorted({k for r in (a, b) for k in r.data.tags if k.startswith("stack.deploy.")})
    out += _table(["deploy", "A", "B"], [(k.removeprefix("stack.deploy."), a.data.tags.get(k, "-"),
                                          b.data.tags.get(k, "-")) for k in deploys]) if deploys else []
    names, notes = sorted(set(a.data.metrics) | set(b.data.metrics)), []
    values = [(k, _metric(a, k, notes), _metric(b, k, notes)) for k in names]
    rows = [(k, _number(x), _number(y), _change(x, y)) for k, x, y in values]
    out += ["", f"metrics (last value; {len(names)}):"] + _table(["metric", "A", "B", "B vs A"], rows)
    return "\n".join(out + [printable(note) for note in notes])


def _table(header: list, rows: list) -> list:
    if not rows:
        return ["(none)"]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(printable(cell) for cell in row) + " |" for row in rows]


def printable(cell) -> str:
    """`cell` as text with control characters escaped (`\\x1b`): run names, tags and params come from the store,
    i.e. from whoever wrote it, and an escape sequence printed raw can clear the screen or retitle the terminal."""
    return escaped(str(cell), 2000)


def _metric(run, key: str, notes: list):
    """The run's last value of metric `key`: a float, None when the run has none, or `NOT_A_NUMBER` when the store
    holds something else there (a line saying what goes into `notes`)."""
    value = run.data.metrics.get(key)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    kind = {str: "text", bytes: "bytes"}.get(type(value), type(value).__name__)
    notes.append(f"run {run.info.run_id[:8]}, metric {key!r}: the store holds {kind} {_short(value)}, not a number "
                 f"(shown as {NOT_A_NUMBER!r}); log the metric again, or fix the store")
    return NOT_A_NUMBER


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _tag(tags: dict, key: str) -> str:
    """A tag's value as text ("" when absent or stored without a value)."""
    value = tags.get(key)
    return "" if value is None else str(value)


def _date(millis) -> str:
    if not millis:
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.gmtime(millis / 1000))
    except (TypeError, ValueError, OverflowError, OSError):  # the store's start_time is text, or out of range
        return "not a date"


def _number(value) -> str:
    if value is None:
        return ""
    return value if value == NOT_A_NUMBER else f"{value:.4g}"


def _change(a, b) -> str:
    if NOT_A_NUMBER in (a, b):
        return "not comparable"
    if a is None or b is None:
        return "only in " + ("B" if a is None else "A")
    if a == b:
        return "same"
    return f"{b - a:+.4g}" + (f" ({b / a:.3g}x)" if a else "")
