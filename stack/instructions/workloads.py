"""The fixed small workloads whose instructions the regression check counts; run inside callgrind.

`python -m stack.instructions.workloads MARKS_LIBRARY LEVEL_FILE [--scale N] [--workloads NAMES]` imports everything, runs each
workload once unmeasured (lazy initialisation, CPython's specialising interpreter and the dispatcher's caches
warm up on a first call), switches callgrind's instrumentation on and runs each workload again inside named
stages: callgrind writes one dump per stage (`stack.instructions.callgrind` reads them). What runs between
stages is zeroed, not counted, and CPython's garbage collector is off while they run (its traversals cost in
proportion to every object the imports left alive, so a new import elsewhere moved a stage's count by 3-5%).

The workloads are the CPU kernels of `stack._C` on the tiny preset's geometry at batch 1 (`bev_geometry_ranks`,
`bev_pool` forward and backward) and one frame of the renderer (six 64 x 32 cameras, twelve road users), split
at the renderer's stages. Inputs are seeded, the process has one thread (callgrind runs threads one at a time,
and an OpenMP pool's spin-waits would make counts depend on scheduling), so counts repeat exactly.

`--scale N` makes the bev_pool context N times wider (N x the channels): the same code doing more work,
which is how the check is shown to fail on a slower kernel without shipping a slow path
(tests/stack/instructions/test_instructions.py; docs/results/benchmarks.md, "The instruction-count check").
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch

BEV_CHANNELS = 32
"""Context channels of the bev_pool workload (the tiny preset's neck)."""
RENDER_AGENTS = 12
RENDER_SIZE = (64, 32)
"""Renderer workload: road users around the ego and each camera's (width, height) in pixels."""
RENDER_STAGES = (("render", "build_primitives"), ("render", "visible_rows"), ("render", "near_rows"),
                 ("render", "cast_frame"), ("render", "in_shadow"), ("frame", "shade"), ("frame", "_expose"),
                 ("frame", "_object_labels"))
"""The renderer's functions that `render_frame` calls, each measured as its own stage (module, name); the code
between them is the stage `render.rest`."""


class Marks:
    """The callgrind client requests of marks.c: start, evict and zero, dump a named stage."""

    def __init__(self, library: str):
        self._lib = ctypes.CDLL(library)
        self._lib.stack_instr_dump.argtypes = [ctypes.c_char_p]

    def start(self) -> None:
        self._lib.stack_instr_start()

    def cold(self) -> None:
        """Evict the simulated caches and zero the counts: the next code is counted from a cold cache, as if
        nothing had run before it (so its misses do not depend on what the process did earlier)."""
        self._lib.stack_instr_evict()
        self._lib.stack_instr_zero()

    def dump(self, stage: str) -> None:
        self._lib.stack_instr_dump(stage.encode())

    @contextlib.contextmanager
    def stage(self, name: str):
        """Count the body as stage `name`: what ran before is discarded, the body's cost is dumped under `name`."""
        self.cold()
        yield
        self.dump(name)


# ----------------------------------------------------------------------------- bev_pool


def bev_inputs(scale: int = 1) -> dict:
    """The tiny preset's rig and grid at batch 1, seeded depth and context (`scale` x its channels)."""
    from stack.config import load_pipeline
    from stack.rig import rig_matrices

    configs = Path(__file__).resolve().parents[2] / "configs"
    pipeline = load_pipeline([configs / "pipeline.yaml", configs / "presets" / "tiny.yaml"], [])
    rig, model = pipeline.data.rig, pipeline.model
    ks, poses = (torch.tensor(m, dtype=torch.float32)[None] for m in rig_matrices(rig))
    return {"rig": (ks, poses, (rig.image_height, rig.image_width), model.feature_stride, model.depth, model.bev),
            "channels": BEV_CHANNELS * scale}


def bev_tensors(inputs: dict):
    """The geometry, and seeded depth, context and incoming gradient for it."""
    from stack.ops import bev_geometry

    g = bev_geometry(*inputs["rig"])
    gen = torch.Generator().manual_seed(0)
    depth = torch.randn(g.batch, g.cameras, g.depth_bins, g.feat_h, g.feat_w, generator=gen).softmax(2)
    context = torch.randn(g.batch, g.cameras, inputs["channels"], g.feat_h, g.feat_w, generator=gen)
    grad = torch.randn(g.batch, inputs["channels"], g.grid_x, g.grid_y, generator=gen)
    return g, depth, context, grad


def run_bev_pool(inputs: dict, marks: Marks | None) -> None:
    """bev_geometry (its C++ ranks kernel), then the bev_pool forward and backward kernels, called directly."""
    from stack.ops import bev_geometry

    stage = marks.stage if marks else lambda name: contextlib.nullcontext()
    with stage("bev_pool.geometry"):
        bev_geometry(*inputs["rig"])
    g, depth, context, grad = bev_tensors(inputs)
    tables = (g.ranks_depth, g.ranks_feat, g.ranks_bev)
    with stage("bev_pool.forward"):
        torch.ops.stack.bev_pool(depth, context, *tables, g.interval_starts, g.interval_lengths, g.batch,
                                 g.grid_x, g.grid_y)
    with stage("bev_pool.backward"):
        torch.ops.stack.bev_pool_backward(grad, depth, context, *tables)


# ----------------------------------------------------------------------------- renderer


def render_inputs() -> dict:
    """A seeded scene, the ground tensors and a rig of six small cameras."""
    from stack.pipeline import RigConfig
    from stack.sim.world import frame
    from stack.sim.world.scene import simulate

    mix = {"car": 0.3, "truck": 0.2, "pedestrian": 0.3, "cyclist": 0.2}
    scene = simulate(np.random.default_rng([11, 0]), 1, 2.0, RENDER_AGENTS, 40.0, mix)
    return {"scene": scene, "ground": frame.TorchGround(scene.town.ground, 5, "cpu"),
            "rig": RigConfig(image_width=RENDER_SIZE[0], image_height=RENDER_SIZE[1])}


def _staged(marks: Marks, name: str, function):
    """`function`, counted as stage `render.<name>`; what render_frame ran since the last stage is `render.rest`."""
    def wrapper(*args, **kwargs):
        marks.dump("render.rest")
        marks.cold()
        result = function(*args, **kwargs)
        marks.dump(f"render.{name.lstrip('_')}")
        marks.cold()
        return result
    return wrapper


@contextlib.contextmanager
def renderer_stages(marks: Marks):
    """Wrap the renderer's stage functions (module attributes, looked up at call time) for one frame."""
    from stack.sim.world import frame, render

    modules = {"render": render, "frame": frame}
    originals = [(modules[module], name, getattr(modules[module], name)) for module, name in RENDER_STAGES]
    for module, name, function in originals:
        setattr(module, name, _staged(marks, name, function))
    try:
        yield
    finally:
        for module, name, function in originals:
            setattr(module, name, function)


def run_render(inputs: dict, marks: Marks | None) -> None:
    """One frame of every camera: cast, shadowed, shaded, exposed and labelled."""
    from stack.sim.world import frame

    scene = inputs["scene"]
    stages = renderer_stages(marks) if marks else contextlib.nullcontext()
    with torch.no_grad(), stages:
        if marks:
            marks.cold()
        frame.render_frame(scene, int(scene.key_steps[0]), inputs["rig"], inputs["ground"],
                           np.random.default_rng(3), "cpu")
        if marks:
            marks.dump("render.rest")


# ----------------------------------------------------------------------------- entry point


def level() -> dict:
    """The ISA level the measured code dispatches to in this process (under valgrind: the CPU valgrind
    presents, which has no AVX-512 whatever the host has), and what decides it."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"level": capability.lower(), "torch_capability": capability,
            "avx512": bool(torch.cpu._is_avx512_supported()), "avx2": bool(torch.cpu._is_avx2_supported())}


WORKLOADS = {"bev_pool": (bev_inputs, run_bev_pool), "render": (lambda scale: render_inputs(), run_render)}
"""Name -> (inputs(scale), run(inputs, marks)); all run unless the command line names some."""


def main(argv: list[str]) -> int:
    import argparse

    import stack._C  # noqa: F401  (the kernels; after torch)

    parser = argparse.ArgumentParser(prog="python -m stack.instructions.workloads")
    parser.add_argument("marks", help="the compiled marks.c")
    parser.add_argument("level_file", type=Path, help="where to write the ISA level this process dispatches to")
    parser.add_argument("--scale", type=int, default=1, help="bev_pool context channels times this")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names of WORKLOADS")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    marks = Marks(args.marks)
    chosen = [WORKLOADS[name] for name in args.workloads.split(",")]
    inputs = [make(args.scale) for make, _ in chosen]
    for (_, run), data in zip(chosen, inputs):
        run(data, None)  # warm-up, not counted
    args.level_file.write_text(json.dumps(level()))
    gc.collect()
    gc.freeze()  # the objects every import left alive are never traversed again: a collection's cost is the
    gc.disable()  # interpreter's, scaled by what else the process holds, not the measured code's; none runs now
    marks.start()
    for (_, run), data in zip(chosen, inputs):
        run(data, marks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
