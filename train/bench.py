"""Training benchmarks (`stack bench train-step`, `stack bench train-memory`), each configuration in a fresh process.

- train-step: one training step of the pipeline's network (synthetic batches from
  `stack.models.testing.random_batch`, so data loading is out of the picture) at fp32
  vs bf16-mixed, with and without activation checkpointing. Reports the median step
  time, the floor (FLOPs of the step from `torch.utils.flop_counter` / the measured
  matmul peak at that dtype), the bytes autograd saves for backward (exact, from
  saved-tensor hooks) and the process's peak resident memory.
- train-memory: 2 ranks on this machine under DDP and FSDP2 (Lightning, gloo on CPU,
  NCCL on GPUs): per-rank parameter + gradient + AdamW-state bytes and peak memory.

Every configuration runs in its own process so peak memory is not inherited.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from stack.pipeline import Pipeline

STEP_CASES = [("32-true", []), ("bf16-mixed", []), ("32-true", ["image_encoder", "bev_encoder"]),
              ("bf16-mixed", ["image_encoder", "bev_encoder"])]


def step_case(pipeline: Pipeline, steps: int = 6) -> dict:
    """Time `steps` training steps after 2 warm-ups in this process; figures for one configuration."""
    from stack.models import build_model
    from stack.models.testing import random_batch
    from stack.train.callbacks import PRECISION_DTYPES, measure_peak_tflops, peak_memory_mb
    from stack.train.parallel import apply_activation_checkpointing

    torch.manual_seed(0)
    train = pipeline.train
    model = build_model(pipeline).train()
    if train.activation_checkpointing:
        apply_activation_checkpointing(model, train.activation_checkpointing)
    batch = random_batch(pipeline, pipeline.data.batch_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = PRECISION_DTYPES[train.precision]

    def step(saved: list | None = None) -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=train.precision != "32-true"):
            if saved is None:
                loss = model.loss(model.forward_batch(batch), batch)["total"]
            else:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
                    loss = model.loss(model.forward_batch(batch), batch)["total"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    saved: list = []
    step(saved)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = measure_peak_tflops(torch.device("cpu"), dtype)
    flops = counter.get_total_flops()
    return {"precision": train.precision, "checkpointing": list(train.activation_checkpointing),
            "step_ms": 1000 * statistics.median(times), "gflop": flops / 1e9, "peak_tflops": peak,
            "floor_ms": 1000 * flops / (peak * 1e12), "saved_for_backward_mb": sum(saved) / 2**20,
            "peak_rss_mb": peak_memory_mb(torch.device("cpu"))}


def _child(config: list[str], overrides: list[str], mode: str, timeout: int = 900) -> dict:
    """Run `python -m stack.train.bench MODE ...` in a fresh process; its JSON result."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    files = [arg for path in config for arg in ("-c", path)]
    result = subprocess.run([sys.executable, "-m", "stack.train.bench", mode, *files, *overrides],
                            capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark case {mode} {overrides} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_step(pipeline: Pipeline, args) -> int:
    """`stack bench train-step`: fp32 vs bf16, with and without activation checkpointing."""
    rows = []
    for precision, checkpointed in STEP_CASES:
        overrides = [*args.overrides, f"train.precision={precision}",
                     f"train.activation_checkpointing=[{','.join(checkpointed)}]"]
        rows.append(_child(args.config, overrides, "step"))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\n| precision | activation checkpointing | step ms | vs fp32 | floor ms (FLOPs/peak) | "
          f"saved for backward MiB | peak RSS MiB |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['precision']} | {', '.join(row['checkpointing']) or 'none'} | {row['step_ms']:.0f} | "
              f"{base['step_ms'] / row['step_ms']:.2f}x | {row['floor_ms']:.0f} ({row['gflop']:.1f} GFLOP / "
              f"{row['peak_tflops']:.2f} TFLOP/s) | {row['saved_for_backward_mb']:.0f} | {row['peak_rss_mb']:.0f} |")
    return 0


def run_memory(pipeline: Pipeline, args) -> int:
    """`stack bench train-memory`: per-rank training state under DDP vs FSDP2 on 2 ranks."""
    rows = {}
    for strategy in ("ddp", "fsdp"):
        overrides = [*args.overrides, f"train.strategy={strategy}", "train.devices=2"]
        rows[strategy] = _child(args.config, overrides, "parallel")
        print(json.dumps({strategy: rows[strategy]}), flush=True)
    ddp, fsdp = rows["ddp"], rows["fsdp"]
    print("\n| strategy | params+grads+AdamW per rank MiB | ratio to DDP | peak RSS per rank MiB | step ms |\n"
          "|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['train_state_mb']:.1f} | {row['train_state_mb'] / ddp['train_state_mb']:.2f} | "
              f"{row['peak_memory_mb']:.0f} | {row['step_ms']:.0f} |")
    return 0 if fsdp["train_state_mb"] <= 0.6 * ddp["train_state_mb"] else 1


def parallel_case(pipeline: Pipeline) -> dict | None:
    """2-rank fit on synthetic batches (this process is one rank); rank 0 returns the figures."""
    from stack.models.testing import random_batch
    from stack.train.data import ResumableLoader
    from stack.train.fit import fit

    def loaders(split: str, rank: int, world: int):
        def epoch(index: int):
            return (random_batch(pipeline, pipeline.data.batch_size, seed=rank * 100 + i) for i in range(8))
        return ResumableLoader(epoch, 8 if split == "train" else 1)

    _, trainer, stats = fit(pipeline, None, loaders, progress=False)
    last = stats.history[-1]
    return {"train_state_mb": last["perf/train_state_mb"], "peak_memory_mb": last["perf/peak_memory_mb"],
            "step_ms": last["perf/step_ms"], "rank": trainer.global_rank} if trainer.is_global_zero else None


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    from stack.config import load_pipeline

    parser = argparse.ArgumentParser(prog="python -m stack.train.bench")
    parser.add_argument("mode", choices=("step", "parallel"))
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    if args.mode == "step":
        print(json.dumps(step_case(load_pipeline(args.config, args.overrides))))
        return 0
    out = os.environ.setdefault("STACK_BENCH_OUT", tempfile.mkdtemp(prefix="stack-bench-"))  # shared with rank 1
    pipeline = load_pipeline(args.config, [*args.overrides, f"train.out_dir={Path(out)}", "train.max_steps=6",
                                           "train.log_every_n_steps=3", "train.accelerator=cpu",
                                           "train.checkpoint_every_n_steps=1000"])
    result = parallel_case(pipeline)
    if result is not None:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
