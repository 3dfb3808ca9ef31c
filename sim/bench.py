"""`stack bench drive`: how fast the closed loop runs, and where its time goes.

Drives `BENCH_EPISODES` episodes (one per scenario family, round-robin) in this process, one thread,
twice: with a camera policy (`stack bench drive` gives the network, `stack.deploy.bench.drive`: the
trained `{train.out_dir}/model.pt` when it exists, else the pipeline's network with untrained weights,
whose cost is the same) and with the blind ego-status rollout, which renders nothing.
Reports simulated seconds per wall second and the split into render / policy / simulation.

The floor: a camera policy cannot run faster than the renderer makes its frames (cameras x replans per
episode); if the policy and the simulation were free, simulated-s per wall-s would be episode seconds
over render seconds. The gap between that and the measured figure is what policy and simulation cost.
The projection for `drive.episodes` with `drive.workers` processes assumes the cores are otherwise idle.
"""

from __future__ import annotations

import time

BENCH_EPISODES = 4
NETWORK_ROW = "network (checkpoint, PyTorch)"


def _drive(pipeline, spec, episodes) -> dict:
    from stack.sim.drive import run_tasks

    start = time.perf_counter()
    rows = run_tasks(pipeline, [(spec, e, None) for e in episodes], workers=1)
    wall = time.perf_counter() - start
    parts = {k: sum(r["timings"][k] for r in rows) for k in ("render", "policy", "simulation")}
    replans = sum(r["replans"] for r in rows)
    return {"wall": wall, "parts": parts, "replans": replans,
            "simulated": pipeline.drive.episode_seconds * len(episodes)}


def run(pipeline, network, weights: str) -> int:
    """Time the camera policy `network` (a PolicySpec; `weights` says which) beside the blind rollout, and print
    the table for BENCHMARKS.md."""
    from stack.sim.drive import cpu_name
    from stack.sim.policies import PolicySpec
    from stack.sim.scenarios import episode_specs

    cfg = pipeline.drive
    episodes = episode_specs(list(cfg.scenarios), BENCH_EPISODES, list(cfg.seeds), cfg.episode_seconds)
    print(f"stack bench drive: {len(episodes)} episodes x {cfg.episode_seconds:g} s, sim {cfg.sim_hz:g} Hz, "
          f"replanning {cfg.replan_hz:g} Hz, {len(pipeline.data.rig.cameras)} cameras at "
          f"{pipeline.data.rig.image_width}x{pipeline.data.rig.image_height}; one process, one thread; "
          f"{cpu_name()}; network: {weights}")
    results = {NETWORK_ROW: _drive(pipeline, network, episodes),
               "blind (ego-status rollout)": _drive(pipeline, PolicySpec("ego_rollout", "ego_rollout"), episodes)}
    print("\n| policy | sim-s / wall-s | wall s | render s | policy s | simulation s | other s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        other = r["wall"] - sum(r["parts"].values())
        print(f"| {name} | {r['simulated'] / r['wall']:.2f} | {r['wall']:.1f} | {r['parts']['render']:.1f} | "
              f"{r['parts']['policy']:.1f} | {r['parts']['simulation']:.1f} | {other:.1f} |")
    net = results[NETWORK_ROW]
    per_frame = net["parts"]["render"] / max(net["replans"], 1)
    floor = net["simulated"] / max(net["parts"]["render"], 1e-9)
    print(f"\nfloor: rendering {len(pipeline.data.rig.cameras)} cameras takes {per_frame * 1000:.0f} ms per replan "
          f"({net['replans']} replans); with policy and simulation free a camera policy would run at "
          f"{floor:.2f} sim-s / wall-s; measured {net['simulated'] / net['wall']:.2f} "
          f"({net['simulated'] / net['wall'] / floor:.0%} of the floor's rate).")
    baselines = len(set(cfg.baselines) | {"expert"})
    per_episode = (net["wall"] + baselines * results["blind (ego-status rollout)"]["wall"]) / len(episodes)
    projected = cfg.episodes * per_episode / max(cfg.workers, 1)
    print(f"projected `stack drive` of {cfg.episodes} episodes (the network + {baselines} baselines, {cfg.workers} workers on idle "
          f"cores): {projected / 60:.1f} min (goal: under 10 min for the tiny preset), plus clips.")
    return 0
