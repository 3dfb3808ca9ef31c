"""`stack eval CHECKPOINT`: every head of a trained network against its trivial baseline on the validation split.

The checkpoint carries its pipeline, so the network is rebuilt exactly (through
`stack.models`, as deploy does); the validation data comes from the pipeline on the
command line (by default the checkpoint's own). Only running a PyTorch network over a loader lives here, for
`stack eval`: the scoring (`stack.metrics.suite.TaskMetrics` over `stack.models.decoders.decode_all`) and the
bars (`stack.metrics.bars`: keep 80% of the tiny recipe's gain over each head's trivial baseline) are the ones
`stack deploy`'s gates apply to a runtime (`stack.deploy.gates.head_scores`).

Results go to `<checkpoint folder>/eval/metrics.json` and a bar chart `heads.png`, and into the
MLflow run that trained the checkpoint when it was tracked (`stack.lineage`). A dataset other
than the one the checkpoint trained on gets a warning naming both and what differs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from stack.metrics.bars import HeadVerdict, all_judged_pass, verdicts
from stack.pipeline import Pipeline


@torch.no_grad()
def evaluate(model: torch.nn.Module, pipeline: Pipeline, batches, device: torch.device,
             limit: int | None = None) -> dict:
    """TaskMetrics of `model` over `batches` (at most `limit` batches); for a temporal network also what it reads
    from the previous key frame (`motion/` keys, `stack.metrics.motion`: a second forward pass per batch)."""
    from stack.metrics.motion import MotionMetric
    from stack.metrics.suite import TaskMetrics
    from stack.models.decoders import decode_all

    metrics = TaskMetrics(pipeline)
    model = model.to(device).eval()
    run = getattr(model, "forward_batch", None) or model
    motion = MotionMetric(pipeline.model.bev) if pipeline.model.temporal_frames and run is not model else None
    count = 0
    for batch in batches:
        if limit is not None and count >= limit:
            break
        batch = batch.to(device)
        outputs = run(batch)
        metrics.update(decode_all(outputs, pipeline), batch.to("cpu"))
        if motion is not None:
            alone = run(batch, fuse_previous=False)["box_regression"]
            motion.update(outputs["box_regression"].cpu(), alone.cpu(), batch.boxes.cpu(), batch.box_labels.cpu())
        count += 1
    found = {f"motion/{key}": value for key, value in motion.compute().items()} if motion is not None else {}
    return {**metrics.compute(), **found, "eval/batches": float(count)}


def evaluate_checkpoint(checkpoint: Path, pipeline: Pipeline | None, progress: bool = True,
                        split: str = "val", chosen_store: str | None = None) -> tuple[dict, Path]:
    """Rebuild the checkpoint's network, evaluate it on `pipeline`'s `split` (val, or train unaugmented); (metrics, out folder).
    `chosen_store`: the tracking store the user chose (`stack.train.tracking.chosen_store`); the eval is logged into
    the checkpoint's run on a remote store only when it is that one."""
    from stack.checkpoint.model_file import load_model_checkpoint
    from stack.data import build_loader
    from stack.data.camera_records import check_rig
    from stack.models import build_model
    from stack.train.parallel import accelerator_name

    stored, state, meta = load_model_checkpoint(checkpoint)
    pipeline = pipeline or stored
    given = warn_on_other_data(meta, pipeline, checkpoint, f"evaluated ({split} split) on")
    check_rig(stored.data.rig, pipeline.data.root, split, f"checkpoint {checkpoint} would be evaluated on")
    model = build_model(stored)
    model.load_state_dict(state)
    device = torch.device("cuda" if accelerator_name(pipeline.train) == "gpu" else "cpu")
    loader = build_loader(pipeline, split, rank=0, world_size=1, shuffle=False, augment=False)
    start = time.perf_counter()
    batches = _with_progress(loader, progress)
    metrics = evaluate(model, stored, batches, device)
    metrics["eval/seconds"] = time.perf_counter() - start
    metrics["eval/global_step"] = float(meta.get("extra", {}).get("global_step", -1))
    out = checkpoint.parent / ("eval" if split == "val" else f"eval-{split}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    plot_verdicts(verdicts(metrics), out / "heads.png")
    attach_eval(meta.get("tracking"), metrics, out, given, chosen_store)
    return metrics, out


def warn_on_other_data(meta: dict, pipeline: Pipeline, checkpoint: Path, what: str) -> dict | None:
    """Print (stderr) the lineage warning when `pipeline`'s dataset is not the one the checkpoint trained on;
    returns the given dataset's fingerprint (`stack.lineage`)."""
    import sys

    from stack.lineage import data_warning, dataset_fingerprint

    given = dataset_fingerprint(pipeline.data.root)
    message = data_warning(meta.get("dataset"), given, str(checkpoint), pipeline.data.root, what)
    if message:
        print(message, file=sys.stderr, flush=True)
    return given


def attach_eval(record: dict | None, metrics: dict, out: Path, given: dict | None, chosen: str | None = None) -> None:
    """Log the eval into the MLflow run that trained the checkpoint: metrics under `<out folder>/` (eval/ or
    eval-train/), metrics.json and heads.png as artifacts, the verdict and the data hash as tags."""
    import sys

    from stack.lineage import attach_to_run

    prefix = out.name
    named = {f"{prefix}/{key.removeprefix('eval/')}": value for key, value in metrics.items()}
    rows = verdicts(metrics)
    named.update({f"{prefix}/{row.head}/passed": float(row.passed) for row in rows})
    tags = {f"stack.{prefix}.verdict": "PASS" if all_judged_pass(rows) else "FAIL",
            f"stack.{prefix}.data_hash": (given or {}).get("hash", "none")}
    attach_to_run(record, named, [(out / "metrics.json", prefix), (out / "heads.png", prefix)], tags,
                  log=lambda line: print(line, file=sys.stderr, flush=True), chosen=chosen, checkpoint_folder=out.parent)


def _with_progress(loader, progress: bool):
    if not progress:
        yield from loader
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("evaluating", total=len(loader))
        for batch in loader:
            yield batch
            bar.advance(task)


def plot_verdicts(rows: list[HeadVerdict], path: Path) -> Path:
    """One panel per head: the model's metric beside its trivial baseline, titled with the bar and verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2))
    for axis, row in zip(axes, rows):
        colour = "tab:green" if row.passed else ("tab:red" if row.judged else "tab:orange")
        axis.bar(["model", "baseline"], [row.value, row.baseline], color=[colour, "tab:gray"])
        axis.set_title(f"{row.head}\n{row.bar}: {row.verdict}", fontsize=9)
        axis.set_ylabel(row.metric)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
