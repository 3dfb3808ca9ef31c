"""`stack dagger`: the student drives, the expert labels what it sees, the student learns from it.

Behaviour cloning trains on the states the expert visits; driving, the student makes small errors and
reaches states no demonstration shows, where its errors compound (Ross & Bagnell 2010: quadratic in the
horizon). DAgger (Ross, Gordon & Bagnell, AISTATS 2011) closes the loop; Roach (Zhang et al., ICCV 2021)
and LBC (Chen et al., CoRL 2019) use it with a privileged expert as here. Each iteration i:

1. **drive**: the current student drives `dagger.episodes` training episodes of every scenario family
   (`stack.sim.recording.training_specs`: worlds that are never evaluation ones), mixed with the expert per
   replanning instant with probability beta_i = beta * beta_decay^(i-1);
2. **label**: every replanning instant is rendered with its labels and the expert's plan from the state
   the student reached (`stack.sim.recording.LabelledFrames`);
3. **aggregate**: the frames become a dataset of their own (`iteration-i/data`), added to training through
   `data.aggregate` beside data.root's train split and every earlier iteration;
4. **fine-tune**: `dagger.steps` steps from the current weights (`iteration-i/train/model.pt`).

The student's closed-loop scores on the episodes it drove (training episodes, scored against the
expert's run of the same episode) are logged per iteration, printed as a table, written to
`dagger.json` and plotted to `dagger.png`; the held-out judgement stays `stack drive`'s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from stack.durable import leftover_pattern, write_atomic
from stack.errors import StackError
from stack.pipeline import Pipeline
from stack.safe_values import escaped

SUMMARY = "dagger.json"


def iteration_specs(pipeline: Pipeline, iteration: int) -> list:
    """The training episodes of iteration `iteration` (1-based): new worlds every iteration, after the
    noisy-expert episodes `stack data make` renders (data.world.drive_episodes)."""
    from stack.sim.recording import training_specs

    dagger, drive = pipeline.dagger, pipeline.drive
    first = pipeline.data.world.drive_episodes + (iteration - 1) * dagger.episodes
    specs = training_specs(drive.scenarios, first + dagger.episodes, drive.episode_seconds)
    return specs[first:]


def beta_of(pipeline: Pipeline, iteration: int) -> float:
    return float(pipeline.dagger.beta * pipeline.dagger.beta_decay ** (iteration - 1))


def check_inputs(pipeline: Pipeline, weights: str | Path) -> None:
    """Everything a DAgger run reads, checked before its first episode is driven (an iteration takes minutes):
    the checkpoint loads, fits its network and has a planner; data.root and every data.aggregate dataset hold a
    train split of frames shards with the cameras of data.rig; train.tracking_uri is a store it may log into."""
    from stack.checkpoint.model_file import load_network
    from stack.data.camera_records import check_rig
    from stack.data.loader import check_layout, dataset_shards, read_manifest
    from stack.train.tracking import check_store

    if pipeline.data.layout != "frames":
        raise StackError(f"stack dagger records frames shards; data.layout is {pipeline.data.layout}: set "
                         f"data.layout=frames (and a frames dataset in data.root)")
    load_network(weights, needs_planner=True)
    manifest = read_manifest(pipeline.data.root)
    check_layout(pipeline, manifest, pipeline.data.root)
    dataset_shards(pipeline, manifest, "train")
    check_rig(pipeline.data.rig, pipeline.data.root, "train", "DAgger would fine-tune on")
    check_store(pipeline)


OUTPUT_FILES = (SUMMARY, "dagger.png", "model.pt")
"""The files a DAgger run writes at the top of dagger.out_dir (beside its iteration-N folders)."""
ITERATION = re.compile(r"iteration-[0-9]+")
LEFTOVER = leftover_pattern(r"dagger\.json|dagger\.png|model\.pt")
"""A temporary file `stack.durable.write_atomic` left behind when a SIGKILL hit before its rename."""


def run_outputs(out: Path) -> list[Path]:
    """What a DAgger run wrote in `out` (what dagger.overwrite=true deletes); anything else there is the user's.
    A symbolic link, or a file where a DAgger run writes a folder (or the reverse), is refused: it was not
    written by a run, and following a link would delete outside `out`."""
    found = []
    for path in sorted(out.iterdir()):
        folder = ITERATION.fullmatch(path.name) is not None
        if not (folder or path.name in OUTPUT_FILES or LEFTOVER.fullmatch(path.name)):
            continue
        if path.is_symlink() or (path.is_dir() != folder):
            kind = "a symbolic link" if path.is_symlink() else "a folder" if path.is_dir() else "a file"
            raise StackError(f"dagger.out_dir {out}: {path.name} is {kind}, which a DAgger run never writes there "
                             f"(expected {'a folder' if folder else 'a file'}), so dagger.overwrite=true will not "
                             f"delete it; move it out of {out}, or choose another dagger.out_dir (nothing was deleted)")
        found.append(path)
    return found


def prepare_out_dir(pipeline: Pipeline, inputs: tuple = ()) -> Path:
    """The DAgger folder, created when missing. One that holds an earlier run is refused unless
    dagger.overwrite=true, which deletes only that run's outputs (`run_outputs`), never the user's other files;
    and refused even then when one of `inputs` (the checkpoint, data.root, data.aggregate) lies among them."""
    out = create_out_dir(pipeline)
    if any(out.iterdir()):
        if not (out / SUMMARY).is_file() and not any(ITERATION.fullmatch(p.name) for p in out.iterdir()):
            raise StackError(f"dagger.out_dir {out} holds files that are not a DAgger run's; choose an empty or new "
                             f"folder (nothing was written)")
        if not pipeline.dagger.overwrite:
            raise StackError(f"dagger.out_dir {out} holds an earlier DAgger run; set dagger.overwrite=true to start "
                             f"over there, or choose another dagger.out_dir")
        outputs = run_outputs(out)
        for given in inputs:
            inside = next((path for path in outputs if _inside(Path(given), path)), None)
            if inside is not None:
                raise StackError(f"{given} lies in {inside}, which dagger.overwrite=true would delete before reading "
                                 f"it; copy it elsewhere and pass the copy, or choose another dagger.out_dir "
                                 f"(nothing was deleted)")
        for path in outputs:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


def create_out_dir(pipeline: Pipeline) -> Path:
    """dagger.out_dir as a writable folder (created when missing; nothing in it is touched), or a StackError."""
    from stack.config import check_folder

    out = Path(pipeline.dagger.out_dir)
    check_folder("dagger.out_dir", str(out))
    if out.is_symlink() and not out.exists():
        raise StackError(f"dagger.out_dir {out} is a symbolic link to {os.readlink(out)}, which does not exist; "
                         f"create that folder, or point dagger.out_dir at a folder (nothing was written)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StackError(f"dagger.out_dir {out} cannot be created ({exc.strerror or exc}); point dagger.out_dir "
                         f"at a folder you can write") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise StackError(f"dagger.out_dir {out} is not writable; point dagger.out_dir at a folder you can write")
    return out


def _inside(path: Path, folder: Path) -> bool:
    """True when `path` is `folder` or lies under it (symbolic links and `..` resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def record(pipeline: Pipeline, student_spec, iteration: int, folder: Path, log=print) -> dict:
    """Drive iteration `iteration`'s episodes with the student (beta-mixed), write the labelled frames as a
    dataset in `folder`, and return the iteration's closed-loop figures."""
    from stack.metrics.driving import aggregate
    from stack.sim.drive import evaluate

    beta = beta_of(pipeline, iteration)
    specs = iteration_specs(pipeline, iteration)
    rows = evaluate(pipeline, [student_spec], specs, log, title=f"DAgger iteration {iteration}: driving (beta {beta:.2f})",
                    record_beta=beta)
    student = [r for r in rows if r["policy"] == student_spec.name]
    frames = write_frames(pipeline, student, folder, iteration, beta)
    summary = aggregate([{k: r[k] for k in ("policy", "family", "seed", "metrics")} for r in rows])
    scores, expert = summary[student_spec.name]["all"], summary["expert"]["all"]
    return {"iteration": iteration, "beta": beta, "episodes": len(specs), "frames": frames,
            "driving_score": scores["driving_score"]["mean"], "pdms": scores["pdms"]["mean"],
            "route_completion": scores["route_completion"]["mean"],
            "expert_driving_score": expert["driving_score"]["mean"], "expert_pdms": expert["pdms"]["mean"],
            "ended": {kind: float(np.mean([r["end"] is not None and r["end"]["kind"] == kind for r in student]))
                      for kind in ("collision", "blocked", "route_deviation")}}


def write_frames(pipeline: Pipeline, rows: list, folder: Path, iteration: int, beta: float) -> int:
    """The rows' labelled frames as a frames-layout dataset (train split only) in `folder`; returns the count."""
    from stack.data.format import ShardWriter, frame_members, write_manifest
    from stack.sim.world.roads import SEG_CLASSES
    from stack.metrics.detection import ATTRIBUTES
    from stack.sim.world.traffic import CLASSES

    cameras = [c.name for c in pipeline.data.rig.cameras]
    writer = ShardWriter(folder / "train", "frames", pipeline.data.samples_per_shard)
    count = 0
    for row in rows:
        for index, frame in enumerate(row.pop("frames")):
            meta = {"source": "closed_loop", "driver": f"student (DAgger iteration {iteration}, beta {beta:.3f})",
                    "family": row["family"], "episode": row["index"], "frame": index,
                    "time_s": round(float(frame["time_s"]), 3), "split": "train",
                    "ended": row["end"]["kind"] if row["end"] else ""}
            writer.write(f"i{iteration:02d}e{row['index']:05d}f{index:04d}",
                         frame_members(frame, cameras, meta, pipeline.data.jpeg_quality))
            count += 1
    writer.close_shard()
    rig = pipeline.data.rig
    write_manifest(folder, {
        "cameras": cameras, "image_size": [rig.image_height, rig.image_width],
        "semantic_classes": list(SEG_CLASSES), "detection_classes": list(CLASSES),
        "attribute_names": list(ATTRIBUTES), "layout": "frames",
        "frames_per_clip": 1, "frame_rate_hz": pipeline.drive.replan_hz, "seed": pipeline.data.world.seed,
        "closed_loop_episodes": len(rows),
        "splits": {"train": [{"path": f"train/{s['path']}", "samples": s["samples"]} for s in writer.shards]}})
    return count


def fine_tune(pipeline: Pipeline, weights: Path, aggregate: list, out: Path) -> Path:
    """`dagger.steps` steps from `weights` on data.root's train split plus `aggregate`, at dagger.lr_scale of
    train.lr; returns the new model.pt."""
    from stack.checkpoint.model_file import load_network
    from stack.train.fit import fit
    from stack.train.tracking import tracking_store_uri

    _, net = load_network(weights, needs_planner=True)
    store = tracking_store_uri(pipeline.train) or "off"  # every iteration's run in the store the user chose
    tuned = replace(pipeline, data=replace(pipeline.data, aggregate=[str(a) for a in aggregate]),
                    train=replace(pipeline.train, out_dir=str(out), max_steps=pipeline.dagger.steps,
                                  lr=pipeline.train.lr * pipeline.dagger.lr_scale, overwrite=True, resume=None, tracking_uri=store))
    fit(tuned, model=lambda _: net.train())
    return out / "model.pt"


def log_iteration(pipeline: Pipeline, weights: Path, figures: dict, log=print) -> None:
    """The iteration's closed-loop figures into the MLflow run of its fine-tuning (found through model.pt)."""
    from stack.checkpoint.model_file import read_lineage
    from stack.lineage import attach_to_run
    from stack.train.tracking import tracking_store_uri

    metrics = {f"dagger/{key}": float(figures[key]) for key in
               ("iteration", "beta", "frames", "driving_score", "pdms", "route_completion", "expert_driving_score",
                "expert_pdms")}
    metrics.update({f"dagger/ended_{kind}": share for kind, share in figures["ended"].items()})
    attach_to_run(read_lineage(weights).get("tracking"), metrics, [], {"stack.dagger.iteration": str(figures["iteration"])},
                  log=log, chosen=tracking_store_uri(pipeline.train))


def run_dagger(pipeline: Pipeline, weights: str | Path, student_builder: type, log=print) -> dict:
    """`dagger.iterations` rounds from `weights` (a model.pt); the student is driven by `student_builder`
    (a `stack.sim.policies.Policy` class that loads a model.pt, e.g. stack.deploy.network_policies.CheckpointPolicy).
    Returns the summary written to dagger.json. The folder's writer lock (`stack.locks`) is held from before an
    earlier run is cleared to the end, so a second `stack dagger` into it is refused before it deletes anything."""
    from stack.locks import folder_lock

    check_inputs(pipeline, weights)
    out = create_out_dir(pipeline)
    busy = (f"another `stack dagger` is writing dagger.out_dir={escaped(str(out))}; two runs there would delete and "
            f"mix each other's iterations. Wait for it to finish, or choose another dagger.out_dir (nothing was written)")
    with folder_lock(out, busy):
        return _run_locked(pipeline, weights, student_builder, log)


def _run_locked(pipeline: Pipeline, weights: str | Path, student_builder: type, log) -> dict:
    """`run_dagger` once dagger.out_dir's writer lock is held: from clearing an earlier run to the summary."""
    from stack.sim.policies import PolicySpec

    out = prepare_out_dir(pipeline, (weights, pipeline.data.root, *pipeline.data.aggregate))
    weights = Path(weights)
    aggregate, history = list(pipeline.data.aggregate), []
    for iteration in range(1, pipeline.dagger.iterations + 1):
        folder = out / f"iteration-{iteration}"
        spec = PolicySpec(f"student {iteration - 1}", "checkpoint", str(weights), builder=student_builder)
        figures = record(pipeline, spec, iteration, folder / "data", log)
        aggregate.append(folder / "data")
        log(f"DAgger iteration {iteration}: the student ({weights}) drove {figures['episodes']} training episodes "
            f"(beta {figures['beta']:.2f}): driving score {figures['driving_score']:.3f}, PDMS {figures['pdms']:.3f} "
            f"(expert {figures['expert_driving_score']:.3f} / {figures['expert_pdms']:.3f}); "
            f"{figures['frames']} labelled frames; fine-tuning {pipeline.dagger.steps} steps on "
            f"{len(aggregate)} recorded dataset(s) + {pipeline.data.root}")
        weights = fine_tune(pipeline, weights, aggregate, folder / "train")
        history.append({**figures, "weights_driven": str(spec.source), "weights_out": str(weights)})
        log_iteration(pipeline, weights, figures, log)
    write_atomic(out / "model.pt", writer=lambda temporary: shutil.copyfile(weights, temporary))
    summary = {"iterations": history, "model": str(out / "model.pt"), "data_root": pipeline.data.root,
               "aggregate": [str(a) for a in aggregate]}
    write_atomic(out / SUMMARY, (json.dumps(summary, indent=2) + "\n").encode())
    plot_history(history, out / "dagger.png")
    return summary


def plot_history(history: list, path: Path) -> Path:
    """Driving score and PDMS of the student per iteration (on the training episodes it drove), beside the expert."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    steps = [h["iteration"] for h in history]
    for key, label in (("driving_score", "driving score"), ("pdms", "PDMS")):
        line, = axis.plot(steps, [h[key] for h in history], marker="o", label=f"student {label}")
        axis.plot(steps, [h[f"expert_{key}"] for h in history], linestyle="--", color=line.get_color(),
                  label=f"expert {label}")
    axis.set_xlabel("DAgger iteration (student driven: weights before the iteration's fine-tuning)")
    axis.set_ylabel("mean over the iteration's training episodes")
    axis.set_ylim(0, 1.05)
    axis.set_xticks(steps)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
