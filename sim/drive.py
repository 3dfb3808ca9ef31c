"""Closed-loop evaluation: every policy drives the same held-out episodes, in parallel worker processes.

`evaluate` runs (policy, episode) pairs in `drive.workers` processes (one torch / ONNX Runtime thread
each; a network loads once per process) and scores each run against the expert's run of the same
episode (NAVSIM's ego-progress term needs it, so the expert always drives). `drive` is what `stack
drive` runs: latencies resolved, episodes driven with a progress bar, the report written
(`stack.sim.drive_report`) and the worst episodes of each policy replayed into MP4 clips.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import re
import shutil
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import numpy as np

from stack.benchrecord.machine import cpu_model
from stack.sim.policies import PolicySpec, build_policy

_PIPELINE = None


def _init_worker(pipeline) -> None:
    import torch

    global _PIPELINE
    _PIPELINE = pipeline
    torch.set_num_threads(1)


PRISTINE_WORLDS = 64
"""Unstepped worlds a driving process keeps (about 6 MB each): an evaluation drives several policies through the
same episodes, and a world takes ~0.6-1 s to build (the town's ground raster, the background traffic and its
first plans) but ~2 ms to copy."""
_pristine: OrderedDict = OrderedDict()


def _world(pipeline, spec):
    """The episode's world (`build_world`, a pure function of the spec and the world config): a copy of the one
    this process built before for this episode, when it keeps one (least recently used dropped first)."""
    from stack.sim.scenarios import build_world

    key = (spec, repr(pipeline.data.world), pipeline.drive.sim_hz)
    if key in _pristine:
        _pristine.move_to_end(key)
    else:
        _pristine[key] = build_world(spec, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
        while len(_pristine) > PRISTINE_WORLDS:
            _pristine.popitem(last=False)
    return copy.deepcopy(_pristine[key])


def forget_worlds() -> None:
    """Drop the worlds this process keeps (`_world`): the next drive of each episode builds it again."""
    _pristine.clear()


def _front_rig(rig):
    """The rig's first camera alone (the clip's front view), at the rig's image size."""
    return replace(rig, cameras=[rig.cameras[0]])


def run_task(task: tuple) -> dict:
    """One (policy, episode, clip path, beta) run in a worker; with a clip path, also renders and writes its MP4.

    With `beta` (not None), the policy drives mixed with the expert (`stack.sim.recording.MixturePolicy`) and
    every replanning instant is recorded with the expert's label: the row's "frames" (DAgger)."""
    from stack.sim.episode import run_episode
    from stack.sim.recording import LabelledFrames, MixturePolicy

    policy_spec, episode, clip_path, beta = (*task, None)[:4]
    pipeline = _PIPELINE
    built = time.perf_counter()
    world = _world(pipeline, episode)
    world_s = time.perf_counter() - built
    built = time.perf_counter()
    policy = build_policy(policy_spec, pipeline)  # once per process: later episodes take it from the cache
    build_s = time.perf_counter() - built
    recorder = None
    if beta is not None:
        policy = MixturePolicy(policy, beta)
        recorder = LabelledFrames(pipeline.data.rig, pipeline.model.planning_steps,
                                  cameras_only=pipeline.data.world.expert_sees == "cameras")
    start = time.perf_counter()
    run = run_episode(world, policy, pipeline.drive, pipeline.data.rig, record_clip=clip_path is not None,
                      clip_rig=_front_rig(pipeline.data.rig), observer=recorder)
    row = {"policy": policy_spec.name, "family": episode.family, "seed": episode.seed, "index": episode.index,
           "latency_ms": policy_spec.latency_s * 1000.0, "trace": run.trace, "replans": run.replans, "end": run.end,
           "timings": dict(run.timings, wall=time.perf_counter() - start, world=world_s, build=build_s)}
    if recorder is not None:
        row["frames"] = recorder.frames
    if clip_path is not None:
        from stack.sim.drive_clips import write_clip

        row["clip"] = str(write_clip(Path(clip_path), run.frames, world.town.ground, pipeline.drive.sim_hz))
    return row


def run_tasks(pipeline, tasks: list, workers: int, on_done=None) -> list[dict]:
    """Every task's row, in task order, run in `workers` processes (in this one when workers <= 1)."""
    rows: list = [None] * len(tasks)
    if workers <= 1 or len(tasks) <= 1:
        import torch

        threads = torch.get_num_threads()
        _init_worker(pipeline)
        try:
            for i, task in enumerate(tasks):
                rows[i] = run_task(task)
                if on_done:
                    on_done(rows[i])
        finally:
            torch.set_num_threads(threads)  # the caller (e.g. stack deploy after its gate) keeps its threads
        return rows
    units = _episode_units(tasks)
    context = multiprocessing.get_context("fork")
    with context.Pool(min(workers, len(units)), initializer=_init_worker, initargs=(pipeline,)) as pool:
        for done in pool.imap_unordered(_run_unit, [[(i, tasks[i]) for i in unit] for unit in units]):
            for i, row in done:
                rows[i] = row
                if on_done:
                    on_done(row)
    return rows


def _episode_units(tasks: list) -> list[list[int]]:
    """Task indices grouped by (whether the policy renders cameras, episode): one worker drives a group's
    policies one after another through one built world (`_world` keeps it), camera groups first (long
    runs first)."""
    units: dict = {}
    for i, task in enumerate(tasks):
        units.setdefault((not task[0].needs_cameras, task[1]), []).append(i)
    return [units[key] for key in sorted(units, key=lambda key: key[0])]


def _run_unit(unit: list) -> list:
    return [(i, run_task(task)) for i, task in unit]


def score_rows(rows: list[dict]) -> list[dict]:
    """Add "metrics" to every row: `score_episode` against the expert's progress on the same episode."""
    from stack.metrics.driving import score_episode

    expert = {(r["family"], r["seed"], r["index"]): (float(r["trace"].progress[-1] - r["trace"].progress[0]),
                                                     (r["trace"].steps - 1) * r["trace"].dt)
              for r in rows if r["policy"] == "expert"}
    for row in rows:
        progress, seconds = expert.get((row["family"], row["seed"], row["index"]), (None, None))
        row["metrics"] = score_episode(row["trace"], progress, seconds)
    return rows


def evaluate(pipeline, policies: list[PolicySpec], episodes: list, log=print, title: str = "driving",
             record_beta: float | None = None) -> list[dict]:
    """Scored rows of every policy on every episode (the expert drives too, for ego progress).

    `record_beta`: every policy but the expert drives mixed with the expert at that beta, and its row keeps the
    labelled frames of the states it visited ("frames", see `run_task`)."""
    from rich.progress import Progress

    if not any(p.kind == "expert" for p in policies):
        policies = list(policies) + [PolicySpec("expert", "expert")]
    tasks = [(policy, episode, None, None if policy.kind == "expert" else record_beta)
             for policy in policies for episode in episodes]
    workers = max(1, min(pipeline.drive.workers, os.cpu_count() or 1))
    log(f"{title}: {len(policies)} policies x {len(episodes)} episodes ({pipeline.drive.episode_seconds:g} s each, "
        f"sim {pipeline.drive.sim_hz:g} Hz, replanning {pipeline.drive.replan_hz:g} Hz) in {workers} process(es)")
    with Progress() as progress:
        bar = progress.add_task(title, total=len(tasks))
        rows = run_tasks(pipeline, tasks, workers, on_done=lambda row: _advance(progress, bar, row))
    return score_rows(rows)


def _advance(progress, bar, row: dict) -> None:
    """Advance the bar, and print a line every 5 % (logs and CI, where no bar is drawn, see progress too)."""
    progress.advance(bar)
    task = progress.tasks[bar]
    every = max(1, int(task.total) // 20)
    if int(task.completed) % every == 0 or task.completed == task.total:
        progress.console.print(f"{int(task.completed)}/{int(task.total)} episodes driven ({task.elapsed or 0:.0f} s; "
                               f"last: {row['policy']}, {row['family']} seed {row['seed']} #{row['index']})")


def resolve_latencies(pipeline, policies: list[PolicySpec], sample_episode, log=print) -> list[PolicySpec]:
    """Each camera policy with its latency: drive.latency_ms when given; else the latency its artifact states
    (a TensorRT bundle's gate.json: measured on the target or predicted); else measured here, one thread, median of 7."""
    from stack.sim.policies import Observation, measure_latency

    given = pipeline.drive.latency_ms
    resolved, observation = [], None
    for spec in policies:
        if not spec.needs_cameras:
            resolved.append(spec)
            continue
        if given >= 0:
            resolved.append(replace(spec, latency_s=given / 1000.0, latency_how=f"given (drive.latency_ms={given:g})"))
            continue
        stated = spec.policy_class.stated_latency(spec)
        if stated is not None:
            resolved.append(replace(spec, latency_s=stated[0], latency_how=stated[1]))
            continue
        if observation is None:
            world = _world(pipeline, sample_episode)
            images = world.render(pipeline.data.rig)["images"]
            x, y, yaw, speed, accel = world.ego_state()
            observation = Observation(0.0, np.array([speed, accel, 0.0], np.float32), world.command(), images, world)
        seconds = measure_latency(build_policy(spec, pipeline), observation)
        runtime = spec.policy_class.runtime or spec.kind
        resolved.append(replace(spec, latency_s=seconds,
                                latency_how=f"measured on this host ({cpu_model()}, {runtime}, 1 thread): {seconds * 1000:.1f} ms"))
        log(f"{spec.name}: latency {seconds * 1000:.1f} ms ({resolved[-1].latency_how})")
    return resolved


def worst_episodes(rows: list[dict], per_policy: int) -> list[dict]:
    """The `per_policy` lowest driving scores (then PDMS) of each policy."""
    chosen = []
    for name in dict.fromkeys(r["policy"] for r in rows):
        own = sorted((r for r in rows if r["policy"] == name),
                     key=lambda r: (r["metrics"]["driving_score"], r["metrics"]["pdms"], r["index"]))
        chosen += own[:per_policy]
    return chosen


def best_episodes(rows: list[dict], per_family: int) -> list[dict]:
    """The `per_family` highest driving scores (then PDMS) of each policy in each scenario family."""
    chosen = []
    for name in dict.fromkeys(r["policy"] for r in rows):
        own = [r for r in rows if r["policy"] == name]
        for family in dict.fromkeys(r["family"] for r in own):
            chosen += sorted((r for r in own if r["family"] == family),
                             key=lambda r: (-r["metrics"]["driving_score"], -r["metrics"]["pdms"], r["index"]))[:per_family]
    return chosen


def drive(pipeline, policies: list[PolicySpec], log=print, sources: dict | None = None) -> dict:
    """`stack drive`: drive every policy on drive.episodes held-out episodes, write drive.md / .json / .png and
    the clips of each policy's worst episodes (and best of each family) into drive.out_dir; returns {"summary",
    "rows", "files"}."""
    from stack.sim.drive_report import write_report
    from stack.metrics.driving import aggregate, closed_loop_bar
    from stack.sim.policies import BASELINE_KINDS

    cfg = pipeline.drive
    if Path(cfg.out_dir).exists() and not Path(cfg.out_dir).is_dir():
        from stack.errors import StackError

        raise StackError(f"drive.out_dir {cfg.out_dir} is a file, not a folder; point drive.out_dir at a folder "
                         f"(the report, drive.json and clips go there); nothing was driven")
    episodes = episodes_of(pipeline)
    policies = resolve_latencies(pipeline, policies, episodes[0], log)
    started = time.perf_counter()
    rows = evaluate(pipeline, policies, episodes, log)
    driving_seconds = time.perf_counter() - started
    summary = aggregate([{k: r[k] for k in ("policy", "family", "seed", "metrics")} for r in rows])
    bars = {p.name: dict(closed_loop_bar(rows, p.name), information=bool(p.alone_of))
            for p in policies if p.kind not in BASELINE_KINDS}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clips = _write_clips(pipeline, policies, rows, out, log) if cfg.clips or cfg.best_clips else {}
    meta = {"pipeline": pipeline.name, "sources": sources or {}, "cpu": cpu_model(), "host_cores": os.cpu_count(),
            "episodes": len(episodes), "split": cfg.split, "seeds": list(cfg.seeds), "scenarios": list(cfg.scenarios),
            "episode_seconds": cfg.episode_seconds, "sim_hz": cfg.sim_hz, "replan_hz": cfg.replan_hz,
            "latency": {p.name: {"ms": p.latency_s * 1000.0, "how": p.latency_how} for p in policies},
            "policies": {p.name: {"kind": p.kind, "blind": p.kind in ("constant_velocity", "ego_rollout"),
                                  "privileged": p.kind == "expert"} for p in policies},
            "wall_seconds": driving_seconds, "workers": cfg.workers, "clips": clips, "bar": bars,
            "post_processing": {p.name: p.guard_settings or pipeline.guard.settings() for p in policies
                                if p.kind not in BASELINE_KINDS},
            "alone_of": {p.name: p.alone_of for p in policies if p.alone_of}}
    public = [{k: v for k, v in r.items() if k != "trace"} for r in rows]
    files = write_report(out, summary, public, meta)
    log(f"drove {len(rows)} episodes in {driving_seconds:.0f} s; report: {out / 'drive.md'}")
    return {"summary": summary, "rows": public, "files": files, "meta": meta, "bar": bars}


def _write_clips(pipeline, policies: list[PolicySpec], rows: list[dict], out: Path, log) -> dict:
    """Replay each policy's worst episodes, and its best of every family (runs are deterministic), with the front
    camera and write MP4s."""
    by_name = {p.name: p for p in policies}
    by_name.setdefault("expert", PolicySpec("expert", "expert"))
    chosen = [(row, "worst") for row in worst_episodes(rows, pipeline.drive.clips)]
    chosen += [(row, "best") for row in best_episodes(rows, pipeline.drive.best_clips)]
    specs = {(e.family, e.seed, e.index): e for e in episodes_of(pipeline)}
    tasks, entries, replayed, copies = [], [], {}, []
    for row, kind in chosen:
        label = re.sub(r"[^\w.-]+", "_", row["policy"])
        name = f"{label}{'-best' if kind == 'best' else ''}-{row['family']}-seed{row['seed']}-ep{row['index']:03d}.mp4"
        episode = (row["policy"], row["index"])
        if episode in replayed:  # a worst episode that is also its family's best: one replay, two names
            copies.append((replayed[episode], out / "clips" / name))
        else:
            replayed[episode] = out / "clips" / name
            tasks.append((by_name[row["policy"]], specs[(row["family"], row["seed"], row["index"])], str(out / "clips" / name)))
        entries.append((row["policy"], {"file": f"clips/{name}", "driving_score": row["metrics"]["driving_score"],
                                        "index": row["index"], "kind": kind}))
    (out / "clips").mkdir(exist_ok=True)
    worst = sum(kind == "worst" for _, kind in chosen)
    log(f"replaying {worst} worst and {len(chosen) - worst} best episodes into clips ({out / 'clips'})")
    run_tasks(pipeline, tasks, max(1, min(pipeline.drive.workers, os.cpu_count() or 1)))
    for source, target in copies:
        shutil.copyfile(source, target)
    clips: dict = {}
    for policy, entry in entries:
        clips.setdefault(policy, []).append(entry)
    return clips


def episodes_of(pipeline) -> list:
    """The `EpisodeSpec`s a drive with `pipeline.drive` drives, in order."""
    from stack.sim.scenarios import episode_specs

    cfg = pipeline.drive
    return episode_specs(list(cfg.scenarios), cfg.episodes, list(cfg.seeds), cfg.episode_seconds, cfg.split)
