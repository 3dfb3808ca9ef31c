"""How much of the renderer's speed is the CPU's vector instruction set? This CPU against itself limited to AVX2.

The generator reaches 79.4 camera images/s on the AVX-512 EPYC and 36.8 on an AVX2-only EPYC (docs/results/data.md,
"Generator"): two machines, two days, two microarchitectures. Here the same frames are rendered on one
machine in child processes that alternate between this CPU's own kernels and the kernels an AVX2-only CPU gets
(`stack.cpu_emulation.emulated_cpu_env("avx2")`: PyTorch's ATen dispatch, oneDNN, MKL and numpy's SIMD dispatch limited
to AVX2), so the ratio is the instruction set's share of the gap and the rest is the other machine's cores.
Each child sets up and renders every key frame of the same seeded scenes of the pipeline's world with one torch
thread (as `stack data make`'s workers do), timed in CPU seconds, and profiles them (cProfile: PyTorch and numpy
calls appear as the built-in functions they are), so the functions that lose most without AVX-512 are named.

    python benchmarks/render_isa.py -c configs/pipeline.yaml -c configs/presets/tiny.yaml [--rounds 3] [--scenes 2]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time

LEVELS = ("native", "avx2")


def render_scenes(pipeline, scenes: int) -> dict:
    """CPU seconds of scene setup and of rendering every key frame of `scenes` scenes, then the functions' own CPU
    seconds while the first scene's frames are rendered again under the profiler (the 40 largest; the timed pass
    runs without it)."""
    import numpy as np
    import torch

    from stack.sim.world import frame
    from stack.sim.world.scene import simulate

    world, rig = pipeline.data.world, pipeline.data.rig
    torch.set_num_threads(1)
    setup = render = 0.0
    images = 0
    first = None
    for index in range(scenes):
        cpu = time.process_time()
        scene = simulate(np.random.default_rng([world.seed, index]), world.frames_per_scene, world.frame_rate_hz,
                         world.agents_per_scene, world.spawn_radius_m, dict(world.class_mix))
        ground = frame.TorchGround(scene.town.ground, world.seed * 100003 + index, "cpu")
        setup += time.process_time() - cpu
        first = first or (scene, ground, index)
        cpu = time.process_time()
        _render_all(frame, scene, rig, ground, np.random.default_rng([world.seed, index, 1]))
        render += time.process_time() - cpu
        images += len(scene.key_steps) * len(rig.cameras)
    profile = cProfile.Profile(time.process_time)
    scene, ground, index = first
    profile.runcall(_render_all, frame, scene, rig, ground, np.random.default_rng([world.seed, index, 1]))
    stats = pstats.Stats(profile)
    functions = sorted(((f"{name} ({os.path.basename(path)}:{line})" if path != "~" else name, row[2])
                        for (path, line, name), row in stats.stats.items()), key=lambda item: -item[1])[:40]
    return {"images": images, "setup_s": setup, "render_s": render, "functions": functions,
            "profiled_s": stats.total_tt}


def _render_all(frame, scene, rig, ground, rng) -> None:
    import torch

    with torch.no_grad():
        for step in scene.key_steps:
            frame.render_frame(scene, int(step), rig, ground, rng, "cpu")


def child(args) -> int:
    from stack.config import load_pipeline
    from stack.cpu_emulation import cpu_kernels, emulation_problems

    level = os.environ.get("STACK_EMULATED_CPU")
    if level and emulation_problems(level):
        print(json.dumps({"error": emulation_problems(level)}))
        return 2
    result = render_scenes(load_pipeline(args.config, args.overrides), args.scenes)
    print(json.dumps({**result, "kernels": cpu_kernels()}))
    return 0


def run_level(args, level: str) -> dict:
    from stack.cpu_emulation import emulated_cpu_env

    env = {**os.environ, **(emulated_cpu_env("avx2") if level == "avx2" else {})}
    command = [sys.executable, __file__, "--child", "--scenes", str(args.scenes),
               *[flag for path in args.config for flag in ("-c", path)], *args.overrides]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"render_isa: the {level} child failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args) -> int:
    runs: dict[str, list[dict]] = {level: [] for level in LEVELS}
    for index in range(args.rounds):
        for level in (LEVELS if index % 2 == 0 else LEVELS[::-1]):
            runs[level].append(run_level(args, level))
        print(f"round {index + 1}/{args.rounds}: " + ", ".join(
            f"{level} {runs[level][-1]['images'] / runs[level][-1]['render_s']:.1f} images/CPU-s" for level in LEVELS),
            flush=True)
    best = {level: min(runs[level], key=lambda run: run["render_s"]) for level in LEVELS}
    images = best["native"]["images"]
    print(f"\n{images} camera images per run, {args.rounds} rounds alternating, best of each (CPU seconds, 1 thread)\n")
    for level in LEVELS:
        print(f"- {level}: {best[level]['kernels']}")
    print("\n| | this CPU's kernels | AVX2 kernels (emulated) | AVX2 / own |\n|---|---:|---:|---:|")
    for name, key in (("render, images/CPU-s", "render_s"), ("scene setup, images/CPU-s", "setup_s")):
        own, avx2 = (images / best[level][key] for level in LEVELS)
        print(f"| {name} | {own:.1f} | {avx2:.1f} | {avx2 / own:.2f}x |")
    own_total, avx2_total = (images / (best[level]["render_s"] + best[level]["setup_s"]) for level in LEVELS)
    print(f"| setup + render, images/CPU-s | {own_total:.1f} | {avx2_total:.1f} | {avx2_total / own_total:.2f}x |")
    print_functions(best)
    return 0


def print_functions(best: dict) -> None:
    """The rendering functions' own CPU time per frame set under both kernels: largest first, and what grew."""
    own = dict(best["native"]["functions"])
    avx2 = dict(best["avx2"]["functions"])
    names = sorted(set(own) | set(avx2), key=lambda name: -avx2.get(name, 0.0))[:15]
    total = {level: best[level]["profiled_s"] for level in LEVELS}
    print("\n| function (own CPU time, the first scene's frames under cProfile) | own kernels s | AVX2 s | AVX2 / own "
          "| share of the AVX2 profile |\n|---|---:|---:|---:|---:|")
    for name in names:
        a, b = own.get(name, 0.0), avx2.get(name, 0.0)
        print(f"| `{name}` | {a:.3f} | {b:.3f} | {b / a if a else float('inf'):.2f}x | {100 * b / total['avx2']:.0f}% |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scenes", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    return child(args) if args.child else compare(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
