"""The renderer side by side with `raycast_reference` on the same scenes (`stack bench data`'s renderer rows).

Both renderers draw every key frame of the same seeded scenes of the pipeline's world, alternating which
goes first frame by frame, in one process with one torch thread (as `stack data make`'s workers run). Each
is timed in CPU seconds of this process (the machine is shared: CPU time is what a core would give on an
idle machine; wall time says how busy it was), and so is scene setup (town, traffic simulation, ground
raster), which both pay. Images per CPU-second x cores is then the rate two idle cores would reach,
before encoding and writing (the `stack data make` row has those).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from stack.data.bench import GOAL_IMAGES_PER_S


@dataclass
class RenderTiming:
    images: int
    setup_cpu_s: float
    new_cpu_s: float
    reference_cpu_s: float
    wall_s: float

    def per_cpu_second(self, render_cpu_s: float) -> float:
        """Camera images per CPU-second of setup + rendering."""
        return self.images / (self.setup_cpu_s + render_cpu_s)


def side_by_side(pipeline, scenes: int = 3, log=None) -> RenderTiming:
    """Render every key frame of `scenes` scenes with both renderers, interleaved; CPU seconds of each."""
    import torch

    from stack.sim.world import frame

    from . import raycast_reference
    from stack.sim.world.scene import simulate

    world, rig = pipeline.data.world, pipeline.data.rig
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    setup = spent_new = spent_reference = 0.0
    images, start = 0, time.perf_counter()
    try:
        for index in range(scenes):
            cpu = time.process_time()
            scene = simulate(np.random.default_rng([world.seed, index]), world.frames_per_scene, world.frame_rate_hz,
                             world.agents_per_scene, world.spawn_radius_m, dict(world.class_mix))
            grounds = {module: module.TorchGround(scene.town.ground, world.seed * 100003 + index, "cpu")
                       for module in (frame, raycast_reference)}
            setup += time.process_time() - cpu
            for number, step in enumerate(scene.key_steps):
                order = (frame, raycast_reference) if number % 2 == 0 else (raycast_reference, frame)
                for module in order:
                    cpu = time.process_time()
                    with torch.no_grad():
                        module.render_frame(scene, int(step), rig, grounds[module],
                                            np.random.default_rng([world.seed, index, 1]), "cpu")
                    spent = time.process_time() - cpu
                    if module is frame:
                        spent_new += spent
                    else:
                        spent_reference += spent
                images += len(rig.cameras)
            if log:
                log(f"renderer side by side: scene {index + 1}/{scenes}")
    finally:
        torch.set_num_threads(threads)
    return RenderTiming(images, setup, spent_new, spent_reference, time.perf_counter() - start)


def rows(timing: RenderTiming, cores: int) -> list[str]:
    """Markdown rows: renderer against reference, and setup + renderer against the 60 images/s goal."""
    new, old = timing.images / timing.new_cpu_s, timing.images / timing.reference_cpu_s
    with_setup = timing.per_cpu_second(timing.new_cpu_s)
    return [
        f"| renderer alone (frame-batched), 1 thread | {new:.1f} images/CPU-s | raycast_reference, same frames, "
        f"interleaved: {old:.1f} images/CPU-s | **{new / old:.2f}x** |",
        f"| scene setup (town, traffic, ground raster) | {timing.images / timing.setup_cpu_s:.1f} images/CPU-s | "
        f"{100 * timing.setup_cpu_s / (timing.setup_cpu_s + timing.new_cpu_s):.0f} % of setup + new renderer, "
        f"{100 * timing.setup_cpu_s / (timing.setup_cpu_s + timing.reference_cpu_s):.0f} % with the reference | |",
        f"| setup + renderer (no encoding) | {with_setup:.1f} images/CPU-s | x {cores} idle cores = "
        f"{with_setup * cores:.1f} images/s, goal {GOAL_IMAGES_PER_S:.0f} | {with_setup * cores / GOAL_IMAGES_PER_S:.2f}x goal |",
    ]
