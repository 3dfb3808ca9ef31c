"""`stack data make`: render the procedural world into train/val frame shards.

Scenes are independent, so they are simulated and rendered in parallel worker
processes (`data.world.workers`, one torch thread each) and written by the main
process in scene order. Every random draw comes from generators seeded by
(`data.world.seed`, scene index), so the same config and seed give byte-identical
shards whatever the number of workers. Validation takes whole scenes (the last
`val_fraction` of them), never frames of a training scene.

With `data.world.drive_episodes`, the train split also holds closed-loop frames: scenario-family episodes
at training seeds driven by the expert with injected noise, each replanning instant labelled with the
expert's plan from the state reached (`stack.sim.recording`); their `meta.json` says where each came from.

The shards are rendered into a staging folder and swapped in only when the whole
dataset is written (`stack.data.staging`): an interrupted run leaves the previous
dataset as it was, and only files a manifest lists are ever replaced.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
from pathlib import Path

import numpy as np

from stack.data import staging
from stack.data.format import SIDECARS, ShardWriter, frame_members, write_manifest
from stack.sim.world.roads import SEG_CLASSES
from stack.metrics.detection import ATTRIBUTES
from stack.sim.world.traffic import CLASSES
from stack.durable import disk_full
from stack.failpoints import fail_point
from stack.pipeline import Pipeline


def split_of(scene: int, scenes: int, val_fraction: float) -> str:
    val = int(round(scenes * val_fraction))
    if val_fraction > 0 and scenes > 1:
        val = max(val, 1)
    return "val" if scene >= scenes - val else "train"


def render_scene(task: tuple) -> list:
    """(key, members) of every key frame of one scene; runs in a worker process."""
    import torch

    from stack.data.format import sample_key
    from stack.sim.world.frame import TorchGround, render_frame
    from stack.sim.world.scene import ego_labels, simulate

    pipeline, scene_index, split, device = task
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic reductions, and one core per worker
    try:
        world = pipeline.data.world
        rig = scene_rig(pipeline.data.rig, world, scene_index)
        scene = simulate(np.random.default_rng([world.seed, scene_index]), world.frames_per_scene,
                         world.frame_rate_hz, world.agents_per_scene, world.spawn_radius_m,
                         dict(world.class_mix))
        ground = TorchGround(scene.town.ground, world.seed * 100003 + scene_index, device)
        noise = np.random.default_rng([world.seed, scene_index, 1])
        samples, frames, cameras = [], [], [c.name for c in rig.cameras]
        for frame_index, step_index in enumerate(scene.key_steps):
            frame = render_frame(scene, int(step_index), rig, ground, noise, device)
            frame.update(ego_labels(scene, int(step_index)))
            frame["boxes"] = np.concatenate([frame["boxes"], frame["visibility"][:, None]], axis=1)
            if pipeline.data.layout == "clips":
                frames.append(frame)
                continue
            meta = {"scene": scene_index, "frame": frame_index, "split": split}
            members = frame_members(frame, cameras, meta, pipeline.data.jpeg_quality)
            samples.append((sample_key(scene_index, frame_index), members))
        if frames:
            from stack.data.clips import clip_members

            meta = {"scene": scene_index, "split": split}
            samples.append((f"s{scene_index:05d}", clip_members(frames, cameras, meta, world.frame_rate_hz)))
        return samples
    finally:
        torch.set_num_threads(threads)


def render_drive_episode(task: tuple) -> list:
    """(key, members) of every replanning instant of one noisy-expert training episode; runs in a worker."""
    import torch

    from stack.sim.policies import PolicySpec
    from stack.sim.recording import NoisyExpertPolicy, record_episode

    pipeline, spec, device = task
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        driver = NoisyExpertPolicy(PolicySpec("noisy expert", "noisy_expert", builder=NoisyExpertPolicy),
                                   pipeline.model.planning_steps, pipeline)
        frames, run = record_episode(spec, driver, pipeline, device)
        cameras = [c.name for c in pipeline.data.rig.cameras]
        samples = []
        for index, frame in enumerate(frames):
            meta = {"source": "closed_loop", "driver": "noisy expert", "family": spec.family, "episode": spec.index,
                    "frame": index, "time_s": round(float(frame["time_s"]), 3), "split": "train",
                    "ended": run.end["kind"] if run.end else ""}
            members = frame_members(frame, cameras, meta, pipeline.data.jpeg_quality)
            samples.append((f"d{spec.index:05d}f{index:04d}", members))
        return samples
    finally:
        torch.set_num_threads(threads)


def scene_rig(rig, world, scene_index: int):
    """`rig` as mounted on the vehicle of scene `scene_index`: each camera's height and pitch moved by up to
    data.world.mount_jitter_m / mount_jitter_deg (uniform, from the scene's own seed), or `rig` itself without
    jitter. A vehicle keeps its calibration for the whole scene."""
    if not (world.mount_jitter_m or world.mount_jitter_deg):
        return rig
    rng = np.random.default_rng([world.seed, scene_index, 2])
    offsets = rng.uniform(-1.0, 1.0, size=(len(rig.cameras), 2)) * [world.mount_jitter_m, world.mount_jitter_deg]
    cameras = [dataclasses.replace(camera, z=camera.z + float(dz), pitch_deg=camera.pitch_deg + float(dpitch))
               for camera, (dz, dpitch) in zip(rig.cameras, offsets)]
    return dataclasses.replace(rig, cameras=cameras)


def _render(task: tuple) -> list:
    return render_scene(task[1:]) if task[0] == "scene" else render_drive_episode(task[1:])


def _drive_specs(pipeline: Pipeline) -> list:
    from stack.sim.recording import training_specs

    episodes = pipeline.data.world.drive_episodes
    return training_specs(pipeline.drive.scenarios, episodes, pipeline.drive.episode_seconds) if episodes else []


def _device(pipeline: Pipeline) -> str:
    choice = pipeline.data.world.render_device
    if choice == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def make_dataset(pipeline: Pipeline, log=print) -> dict:
    """Render every scene of `pipeline.data.world` into `pipeline.data.root`; returns the manifest."""
    world, root = pipeline.data.world, Path(pipeline.data.root)
    device = _device(pipeline)
    splits = {s: split_of(s, world.scenes, world.val_fraction) for s in range(world.scenes)}
    per_shard = pipeline.data.samples_per_shard
    if pipeline.data.layout == "clips":  # a clip holds a whole scene: keep shards about as large as frame shards
        per_shard = max(1, per_shard // world.frames_per_scene)
    stage = staging.prepare(root, log)
    kept = f"The dataset in data.root={str(root)!r} is as it was: the new one was being written to {stage}, now removed"
    with disk_full(stage, kept, remove=stage):
        _render_into(pipeline, stage, device, splits, per_shard, log)
    fail_point("data-before-swap")
    return staging.commit(root, log)


def _render_into(pipeline: Pipeline, stage: Path, device: str, splits: dict, per_shard: int, log) -> dict:
    """Render every scene and closed-loop episode into shards under the staging folder, then its manifest."""
    from rich.progress import Progress

    world, root = pipeline.data.world, Path(pipeline.data.root)
    staging.check_free(root, _planned_files(pipeline, splits, per_shard))
    writers = {split: ShardWriter(stage / split, pipeline.data.layout, per_shard) for split in ("train", "val")}
    drives = _drive_specs(pipeline)
    tasks = [("scene", pipeline, s, splits[s], device) for s in range(world.scenes)]
    tasks += [("drive", pipeline, spec, device) for spec in drives]
    task_splits = [splits[s] for s in range(world.scenes)] + ["train"] * len(drives)
    workers = min(world.workers, len(tasks))
    context = multiprocessing.get_context("spawn" if device == "cuda" else "fork")
    log(f"rendering {world.scenes} scenes x {world.frames_per_scene} frames x {len(pipeline.data.rig.cameras)} cameras "
        + (f"and {len(drives)} closed-loop training episodes " if drives else "")
        + f"on {device} with {max(workers, 1)} process(es) -> {root} (staged in {stage} until complete)")
    with Progress() as progress:
        bar = progress.add_task("rendering scenes", total=len(tasks))
        if workers > 1:
            with context.Pool(workers) as pool:
                for index, samples in enumerate(pool.imap(_render, tasks)):
                    _write(writers[task_splits[index]], samples)
                    _advance(progress, bar, index, tasks, task_splits[index])
        else:
            for index, task in enumerate(tasks):
                _write(writers[task_splits[index]], _render(task))
                _advance(progress, bar, index, tasks, task_splits[index])
    for writer in writers.values():
        writer.close_shard()
    manifest = {
        "cameras": [c.name for c in pipeline.data.rig.cameras],
        "image_size": [pipeline.data.rig.image_height, pipeline.data.rig.image_width],
        "semantic_classes": list(SEG_CLASSES), "detection_classes": list(CLASSES),
        "attribute_names": list(ATTRIBUTES),
        "layout": pipeline.data.layout, "frames_per_clip": world.frames_per_scene,
        "frame_rate_hz": world.frame_rate_hz, "seed": world.seed, "closed_loop_episodes": len(drives),
        "splits": {split: [{"path": f"{split}/{s['path']}", "samples": s["samples"]} for s in w.shards]
                   for split, w in writers.items()},
    }
    return write_manifest(stage, manifest)


def _planned_files(pipeline: Pipeline, splits: dict, per_shard: int) -> list[str]:
    """Paths (relative to data.root) of the shards and sidecars this run will write (at most: a closed-loop
    episode that ends early writes fewer frames)."""
    per_scene = 1 if pipeline.data.layout == "clips" else pipeline.data.world.frames_per_scene
    drive = pipeline.drive
    per_episode = math.ceil(drive.episode_seconds * drive.replan_hz)
    paths = []
    for split in ("train", "val"):
        samples = per_scene * sum(1 for s in splits.values() if s == split)
        if split == "train":
            samples += per_episode * pipeline.data.world.drive_episodes
        for shard in range(-(-samples // per_shard)):
            paths += [f"{split}/{pipeline.data.layout}-{shard:06d}{suffix}" for suffix in (".tar", *SIDECARS)]
    return paths


def _advance(progress, bar, index: int, tasks: list, split: str) -> None:
    """Advance the bar, and log a line per scene or episode (visible in logs where no bar is drawn)."""
    fail_point("data-render")
    progress.advance(bar)
    elapsed = progress.tasks[bar].elapsed or 0.0
    what = "scene" if tasks[index][0] == "scene" else f"closed-loop episode ({tasks[index][2].family})"
    progress.console.print(f"{what} {index + 1}/{len(tasks)} written to {split} ({elapsed:.0f} s elapsed)")


def _write(writer: ShardWriter, samples: list) -> None:
    for key, members in samples:
        writer.write(key, members)
