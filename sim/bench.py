"""`stack bench drive`: how fast the closed loop runs, and where its time goes.

Drives `BENCH_EPISODES` episodes (one per scenario family, round-robin) in this process, one thread,
with a camera policy (`stack bench drive` gives the network, `stack.commands.drive.bench`: the
trained `{train.out_dir}/model.pt` when it exists, else the pipeline's network with untrained weights,
whose cost is the same), with each deployed bundle's model on ONNX Runtime given (`stack bench drive BUNDLE ...`),
and with the blind ego-status rollout, which renders nothing.
A third run drives the network as `stack dagger` does: every replanning instant is also rendered with its labels
and labelled by the expert (`stack.sim.recording`). Reports episodes per minute, simulated seconds per wall
second and the split into render / policy / simulation / labelling / world building, with the policy's one
build (a worker process builds each policy once for all its episodes: `stack.sim.policies.build_policy`) in a
column of its own and left out of the rates.

The floor: a camera policy cannot run faster than the renderer makes its frames (cameras x replans per
episode); if the policy, the simulation and building the episode's world were free, simulated-s per wall-s
would be episode seconds over render seconds. The gap between that and the measured figure is what they cost.
The projection for `drive.episodes` with `drive.workers` processes assumes the cores are otherwise idle.
"""

from __future__ import annotations

import time

BENCH_EPISODES = 4
NETWORK_ROW = "network (checkpoint, PyTorch)"
BLIND_ROW = "blind (ego-status rollout)"


PARTS = ("render", "policy", "simulation", "labelling", "world", "build")
"""The timed parts of a drive: per replan (render, policy, labelling), per step (simulation), per episode (world:
building or copying its world) and per process (build: the policy, built once and cached)."""
DAGGER_ROW = "network, recorded for DAgger (labelled frames)"


def _drive(pipeline, spec, episodes, record: bool = False) -> dict:
    from stack.sim.drive import forget_worlds, run_tasks

    forget_worlds()  # each row pays for building its worlds, as the first policy of an evaluation does
    start = time.perf_counter()
    rows = run_tasks(pipeline, [(spec, e, None, 0.0 if record else None) for e in episodes], workers=1)
    wall = time.perf_counter() - start
    per_episode = {k: [r["timings"][k] for r in rows] for k in PARTS}
    replans = sum(r["replans"] for r in rows)
    return {"wall": wall, "parts": {k: sum(v) for k, v in per_episode.items()}, "per_episode": per_episode,
            "replans": replans, "simulated": pipeline.drive.episode_seconds * len(episodes)}


def steady_rate(result: dict) -> float:
    """Simulated seconds per wall second once the policy is built (a worker builds it once for all its episodes)."""
    return result["simulated"] / max(result["wall"] - result["parts"]["build"], 1e-9)


def floor_rate(result: dict) -> float:
    """Simulated seconds per wall second of a camera policy whose planning and simulation were free: the rate its
    rendering alone allows."""
    return result["simulated"] / max(result["parts"]["render"], 1e-9)


def record_figures(figures, results: dict, cameras: set) -> None:
    """Each policy's simulated seconds per wall second (one run of BENCH_EPISODES; for the camera policies named in
    `cameras`, the floor: the rate with policy and simulation free) and its timed parts per episode, for --record."""
    for name, r in results.items():
        figures.add(f"{name}: sim-s per wall-s", [steady_rate(r)], "sim-s/wall-s", lower_is_better=False,
                    floor=floor_rate(r) if name in cameras else None)
        for part, seconds in r["per_episode"].items():
            if any(seconds):
                figures.add(f"{name}: {part} per episode", seconds, "s")


def run(pipeline, network, weights: str, figures=None, bundles=()) -> int:
    """Time the camera policy `network` (a PolicySpec; `weights` says which), and the deployed `bundles` (PolicySpecs),
    beside the blind rollout, and print the table (for a dated docs/log entry, then docs/results/closed-loop.md,
    "Speed of the closed loop"); the figures go into `figures` (a `stack.benchrecord.FigureLog`) when given."""
    from stack.benchrecord.machine import cpu_model
    from stack.sim.policies import PolicySpec
    from stack.sim.scenarios import episode_specs

    cfg = pipeline.drive
    episodes = episode_specs(list(cfg.scenarios), BENCH_EPISODES, list(cfg.seeds), cfg.episode_seconds)
    print(f"stack bench drive: {len(episodes)} episodes x {cfg.episode_seconds:g} s, sim {cfg.sim_hz:g} Hz, "
          f"replanning {cfg.replan_hz:g} Hz, {len(pipeline.data.rig.cameras)} cameras at "
          f"{pipeline.data.rig.image_width}x{pipeline.data.rig.image_height}; one process, one thread; "
          f"{cpu_model()}; network: {weights}")
    results = {NETWORK_ROW: _drive(pipeline, network, episodes)}
    for bundle in bundles:
        results[bundle_row(bundle)] = _drive(pipeline, bundle, episodes)
    results[DAGGER_ROW] = _drive(pipeline, network, episodes, record=True)
    results[BLIND_ROW] = _drive(pipeline, PolicySpec("ego_rollout", "ego_rollout"), episodes)
    print("\n| policy | episodes / min | sim-s / wall-s | wall s | render s | policy s | simulation s | labelling s | "
          "world s | policy built s | other s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():  # rates once the policy is built; its one build is a column of its own
        other = r["wall"] - sum(r["parts"].values())
        steady = r["wall"] - r["parts"]["build"]
        print(f"| {name} | {len(episodes) / steady * 60:.1f} | {steady_rate(r):.2f} | {r['wall']:.1f} | "
              + " | ".join(f"{r['parts'][k]:.1f}" for k in PARTS) + f" | {other:.1f} |")
    net = results[NETWORK_ROW]
    timed = [NETWORK_ROW] + [bundle_row(bundle) for bundle in bundles]  # a plan per rendered frame
    if figures is not None:
        record_figures(figures, results, set(timed))
    for name in timed:
        print(floor_line(name, results[name], len(pipeline.data.rig.cameras)))
    baselines = len(set(cfg.baselines) | {"expert"})
    per_episode = (net["wall"] + baselines * results[BLIND_ROW]["wall"]) / len(episodes)
    projected = cfg.episodes * per_episode / max(cfg.workers, 1)
    print(f"projected `stack drive` of {cfg.episodes} episodes (the network + {baselines} baselines, {cfg.workers} workers on idle "
          f"cores): {projected / 60:.1f} min (goal: under 10 min for the tiny preset), plus clips.")
    return 0


def bundle_row(bundle) -> str:
    return f"network ({bundle.name}, ONNX Runtime)"


def floor_line(name: str, result: dict, cameras: int) -> str:
    """What the renderer allows a camera policy and how close `name` came to it."""
    per_frame, floor, measured = result["parts"]["render"] / max(result["replans"], 1), floor_rate(result), \
        steady_rate(result)
    return (f"\n{name}: rendering {cameras} cameras takes {per_frame * 1000:.0f} ms per replan ({result['replans']} "
            f"replans); with policy, simulation and world building free it would run at {floor:.2f} sim-s / wall-s "
            f"(the floor); measured {measured:.2f} once the policy is built: {measured / floor:.0%} of the floor's "
            f"rate (goal: 80%).")
