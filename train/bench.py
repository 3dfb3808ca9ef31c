"""Training benchmarks: `stack bench train-step` and `stack bench train-memory`.

- train-step: one training step of the pipeline's network (synthetic batches from
  `stack.synthetic_batch.random_batch`, so data loading is out of the picture) as `stack train`
  runs it, at fp32 and bf16-mixed, and each of its speed choices turned back one at a time
  (`STEP_CASES`: activation checkpointing on, images entering the backbone NCHW instead of
  channels-last, GroupNorm through ATen's channels-last kernel, foreach instead of fused
  AdamW). The configurations run in one process, interleaved step by step (round robin), so they share whatever
  else the machine is doing; the median of each is reported with its floor (FLOPs of
  the step from `torch.utils.flop_counter` with `stack.train.callbacks.step_flop_counter`'s
  convolution-backward formula / the matmul peak at that dtype, measured
  interleaved the same way) and the bytes autograd saves for backward (exact, from
  saved-tensor hooks: the activation memory that checkpointing trades for recompute).
- train-memory: 2 ranks on this machine under DDP and FSDP2 (Lightning, gloo on CPU,
  NCCL on GPUs), each case in its own processes: per-rank parameter + gradient +
  AdamW-state bytes, peak memory, and the bytes each rank sends per step in collectives
  (measured at the calls, `stack.train.comm`), FSDP2 with fp32 and with bf16 parameter
  gathers (32-true vs bf16-mixed), beside what the ring algorithms must send at least:
  FSDP2 all-gathers every parameter in forward and again in backward and reduce-scatters
  the fp32 gradients, (2 x gathered bytes + gradient bytes) x (r-1)/r; DDP all-reduces
  the fp32 gradients, 2 x gradient bytes x (r-1)/r. Beside the bytes counted at the calls, what
  each rank put on the wire in the same steps (TCP bytes the kernel counted, `WireBytes`): DDP's
  agree with the count; FSDP2's exceed it by gloo's reduce-scatter, which sends an all-reduce's
  bytes (twice the ring figure) on CPU ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from stack.benchrecord import figures_of
from stack.pipeline import Pipeline

@dataclass(frozen=True)
class StepCase:
    """One configuration of `stack bench train-step`; the defaults are how `stack train` steps the network."""

    precision: str
    checkpointed: tuple[str, ...] = ()
    channels_last: bool = True
    """Images enter the backbone channels-last (`ImageEncoder.channels_last`)."""
    aten_group_norm: bool = False
    """GroupNorm through ATen's channels-last CPU kernel instead of `stack.models.layers.GroupNorm`'s layout."""
    optimizer: str = "fused"
    """AdamW's kernel: "fused" (`stack.train.module.build_adamw`) or "foreach"."""

    @property
    def label(self) -> str:
        """The figure's name in a record: the first five keep the names their history has."""
        parts = [f"step: {self.precision}, checkpointing {', '.join(self.checkpointed) or 'none'}"]
        parts += [] if self.channels_last else ["NCHW images"]
        parts += ["ATen channels-last GroupNorm"] if self.aten_group_norm else []
        parts += [] if self.optimizer == "fused" else [f"{self.optimizer} AdamW"]
        return ", ".join(parts)


CHECKPOINTED = ("image_encoder", "bev_encoder")
STEP_CASES = [StepCase("32-true"), StepCase("bf16-mixed"), StepCase("32-true", CHECKPOINTED),
              StepCase("bf16-mixed", CHECKPOINTED), StepCase("32-true", channels_last=False),
              StepCase("32-true", aten_group_norm=True), StepCase("bf16-mixed", aten_group_norm=True),
              StepCase("32-true", optimizer="foreach"), StepCase("bf16-mixed", optimizer="foreach")]
"""The network as `stack train` steps it in fp32 and bf16, then each choice it makes turned back one at a time:
activation checkpointing on, NCHW images, ATen's channels-last GroupNorm, the foreach AdamW."""


def _case_step(pipeline: Pipeline, case: StepCase, batch):
    """A closure running one training step of a fresh network in this configuration."""
    from stack.models import build_model
    from stack.models.layers import GroupNorm
    from stack.train.callbacks import PRECISION_DTYPES
    from stack.train.module import build_adamw
    from stack.train.parallel import apply_activation_checkpointing

    torch.manual_seed(0)
    model = build_model(pipeline).train()
    model.image_encoder.channels_last = case.channels_last
    if case.aten_group_norm:
        for module in model.modules():
            if isinstance(module, GroupNorm):
                module.forward = types.MethodType(torch.nn.GroupNorm.forward, module)
    if case.checkpointed:
        apply_activation_checkpointing(model, list(case.checkpointed))
    optimizer = (build_adamw(model.parameters(), lr=1e-4) if case.optimizer == "fused"
                 else torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
    dtype = PRECISION_DTYPES[case.precision]

    def step(saved: list | None = None) -> None:
        hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t)
                 if saved is not None else contextlib.nullcontext())
        with torch.autocast("cpu", dtype=dtype, enabled=case.precision != "32-true"), hooks:
            loss = model.loss(model.forward_batch(batch), batch)["total"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def step_cases(pipeline: Pipeline, rounds: int = 6) -> list[dict]:
    """Every STEP_CASES configuration, interleaved for `rounds` rounds after a warm-up; one row each."""
    from stack.synthetic_batch import random_batch
    from stack.train.callbacks import PRECISION_DTYPES, measure_peak_tflops, step_flop_counter

    batch = random_batch(pipeline, pipeline.data.batch_size, seed=0)
    steps = [_case_step(pipeline, case, batch) for case in STEP_CASES]
    rows = []
    for case, step in zip(STEP_CASES, steps):
        step()  # warm-up (allocator, oneDNN primitives)
        saved: list = []
        step(saved)
        with step_flop_counter() as counter:  # grouped convolutions' weight gradients counted once
            step()
        rows.append({"case": case, "precision": case.precision, "checkpointing": list(case.checkpointed),
                     "images": "channels-last" if case.channels_last else "NCHW",
                     "group_norm": "ATen channels-last" if case.aten_group_norm else "contiguous",
                     "optimizer": case.optimizer, "gflop": counter.get_total_flops() / 1e9,
                     "saved_for_backward_mb": sum(saved) / 2**20, "times": [], "peaks": []})
    for _ in range(rounds):
        for row, step in zip(rows, steps):
            start = time.perf_counter()
            step()
            row["times"].append(time.perf_counter() - start)
            row["peaks"].append(measure_peak_tflops(torch.device("cpu"), PRECISION_DTYPES[row["precision"]],
                                                    seconds=0.2))
    for row in rows:
        row["step_ms"] = 1000 * statistics.median(row["times"])
        row["peak_tflops"] = max(row.pop("peaks"))
        row["floor_ms"] = row["gflop"] / row["peak_tflops"]
    return rows


def _child(config: list[str], overrides: list[str], mode: str, timeout: int = 900) -> dict:
    """Run `python -m stack.train.bench MODE ...` in a fresh process; its JSON result."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    files = [arg for path in config for arg in ("-c", path)]
    result = subprocess.run([sys.executable, "-m", "stack.train.bench", mode, *files, *overrides],
                            capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark case {mode} {overrides} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def floor_cell(row: dict) -> str:
    """The floor column of one train-step row.

    The floor is the step's FLOPs over the matmul peak at its dtype. On a CPU without bf16
    instructions the bf16 matmul falls back to a scalar path slower than the convolutions
    oneDNN runs for the same step, so "FLOPs / matmul peak" exceeds the measured step: that
    is no floor, and the cell says so instead of printing a bound the step already beats.
    """
    probe = f"{row['gflop']:.1f} GFLOP / {row['peak_tflops']:.4g} TFLOP/s"
    if row["floor_ms"] > row["step_ms"]:
        return f"none: the matmul probe ({probe}) is slower than the step"
    return f"{row['floor_ms']:.0f} ({probe})"


def record_step_figures(figures, rows: list[dict]) -> None:
    """Every interleaved step time of each configuration, for --record; the floor only where it is one
    (`floor_cell`)."""
    for row in rows:
        floor = row["floor_ms"] / 1e3 if row["floor_ms"] <= row["step_ms"] else None
        figures.add(row["case"].label, row["times"], "s", floor=floor)


def _row(rows: list[dict], case: StepCase) -> dict:
    return next(row for row in rows if row["case"] == case)


def run_step(pipeline: Pipeline, args) -> int:
    """`stack bench train-step`: the step as `stack train` runs it in fp32 and bf16 against its FLOP floor, and
    each of its choices (activation checkpointing, channels-last images, GroupNorm's layout, fused AdamW) side by
    side with its alternative, interleaved."""
    rows = step_cases(pipeline)
    record_step_figures(figures_of(args), rows)
    fp32, bf16 = _row(rows, StepCase("32-true")), _row(rows, StepCase("bf16-mixed"))
    print("| precision | activation checkpointing | images | GroupNorm | AdamW | step ms (median) | speed vs fp32 | "
          "step / floor | floor ms (GFLOP / peak) | saved for backward MiB |\n|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = f"{row['step_ms'] / row['floor_ms']:.1f}x" if row["floor_ms"] <= row["step_ms"] else "-"
        print(f"| {row['precision']} | {', '.join(row['checkpointing']) or 'none'} | {row['images']} | "
              f"{row['group_norm']} | {row['optimizer']} | {row['step_ms']:.0f} | "
              f"{fp32['step_ms'] / row['step_ms']:.2f}x | {ratio} | {floor_cell(row)} | "
              f"{row['saved_for_backward_mb']:.0f} |")
    print(f"bf16 vs fp32: {fp32['step_ms'] / bf16['step_ms']:.2f}x; activation checkpointing costs "
          + " / ".join(f"{_row(rows, StepCase(base['precision'], CHECKPOINTED))['step_ms'] / base['step_ms']:.2f}x "
                       f"({'fp32' if base is fp32 else 'bf16'})" for base in (fp32, bf16))
          + f" step time for {_row(rows, StepCase('32-true', CHECKPOINTED))['saved_for_backward_mb'] / fp32['saved_for_backward_mb']:.2f}x "
          f"the saved activations; channels-last images vs NCHW (fp32): "
          f"{_row(rows, StepCase('32-true', channels_last=False))['step_ms'] / fp32['step_ms']:.2f}x")
    for name, changed in (("GroupNorm in the contiguous layout vs ATen's channels-last kernel", {"aten_group_norm": True}),
                          ("fused vs foreach AdamW", {"optimizer": "foreach"})):
        gains = [f"{_row(rows, StepCase(base['precision'], **changed))['step_ms'] / base['step_ms']:.2f}x "
                 f"({'fp32' if base is fp32 else 'bf16'})" for base in (fp32, bf16)]
        print(f"{name}: {' / '.join(gains)}")
    return 0


MEMORY_CASES = [("ddp", "32-true"), ("fsdp", "32-true"), ("fsdp", "bf16-mixed")]
RANKS = 2


def comm_floor_mb(row: dict, strategy: str, precision: str, ranks: int = RANKS) -> float:
    """MiB a rank must send per step: see the module docstring (norms and `keep_fp32` layers gather in fp32)."""
    share = (ranks - 1) / ranks
    gradients = 4 * row["params"]
    if strategy == "ddp":
        return 2 * gradients * share / 2**20
    gathered = 4 * row["params"] if precision == "32-true" else 2 * (row["params"] - row["fp32_params"]) + 4 * row[
        "fp32_params"]
    return (2 * gathered + gradients) * share / 2**20


def comm_cell(comm: dict, kind: str) -> str:
    """'<MiB sent> (<dtype>)' of one collective kind, summed over dtypes."""
    rows = {key.split("/")[1]: value for key, value in comm.items() if key.startswith(kind + "/")}
    if not rows:
        return "-"
    return f"{sum(r['sent_mb'] for r in rows.values()):.2f} ({', '.join(sorted(rows))})"


def wire_cell(row: dict) -> str:
    """The bytes a rank put on the wire per step (each once), their ratio to the bytes counted at the calls, and
    what TCP sent again (`stack.train.comm.WireCount`: a loaded machine's late ACKs make the kernel resend)."""
    if row.get("wire_mb") is None:
        return "not readable here"
    counted = sum(value["sent_mb"] for value in row["comm"].values())
    cell = f"{row['wire_mb']:.2f} ({row['wire_mb'] / counted:.2f}x)" if counted else f"{row['wire_mb']:.2f}"
    retransmitted = row.get("retransmitted_mb") or 0.0
    return f"{cell}, {retransmitted:.2f} resent" if retransmitted else cell


def record_memory_figures(figures, rows: dict) -> None:
    """Each case's one run, for --record: state, peak and bytes sent (its floor: what the ring must send)."""
    for (strategy, precision), row in rows.items():
        case = f"{strategy} {precision}"
        figures.add(f"{case}: params+grads+AdamW per rank", [row["train_state_mb"]], "MiB")
        figures.add(f"{case}: peak RSS per rank", [row["peak_memory_mb"]], "MiB")
        figures.add(f"{case}: step", [row["step_ms"]], "ms")
        figures.add(f"{case}: sent per rank per step", [sum(v["sent_mb"] for v in row["comm"].values())], "MiB",
                    floor=comm_floor_mb(row, strategy, precision))
        if row.get("wire_mb") is not None:
            figures.add(f"{case}: on the wire per rank per step", [row["wire_mb"]], "MiB",
                        floor=comm_floor_mb(row, strategy, precision))


def run_memory(pipeline: Pipeline, args) -> int:
    """`stack bench train-memory`: per-rank state and bytes sent under DDP vs FSDP2 (fp32, bf16 gathers), 2 ranks."""
    rows = {}
    for strategy, precision in MEMORY_CASES:
        overrides = [*args.overrides, f"train.strategy={strategy}", f"train.devices={RANKS}",
                     f"train.precision={precision}", "train.count_comm_bytes=true"]
        rows[strategy, precision] = _child(args.config, overrides, "parallel")
        print(json.dumps({f"{strategy} {precision}": rows[strategy, precision]}), flush=True)
    record_memory_figures(figures_of(args), rows)
    ddp, fsdp, fsdp_bf16 = (rows[case] for case in MEMORY_CASES)
    print("\n| strategy | precision | params+grads+AdamW per rank MiB | ratio to DDP | peak RSS per rank MiB | "
          "step ms | sent per rank per step MiB: all-gather / reduce-scatter / all-reduce | total | on the wire (TCP) | "
          "floor |\n|---|---|---|---|---|---|---|---|---|---|")
    for (strategy, precision), row in rows.items():
        comm = row["comm"]
        sent = sum(value["sent_mb"] for value in comm.values())
        print(f"| {strategy} | {precision} | {row['train_state_mb']:.1f} | "
              f"{row['train_state_mb'] / ddp['train_state_mb']:.2f} | {row['peak_memory_mb']:.0f} | "
              f"{row['step_ms']:.0f} | {' / '.join(comm_cell(comm, k) for k in ('all_gather', 'reduce_scatter', 'all_reduce'))}"
              f" | {sent:.2f} | {wire_cell(row)} | {comm_floor_mb(row, strategy, precision):.2f} |")
    gathered = {key: sum(v["sent_mb"] for k, v in rows[key]["comm"].items() if k.startswith("all_gather/"))
                for key in MEMORY_CASES[1:]}
    ratio = gathered[MEMORY_CASES[2]] / gathered[MEMORY_CASES[1]]
    print(f"bf16 gathers send {ratio:.2f}x the bytes of fp32 gathers (bar: <= 0.6); "
          f"{ddp['params'] / 1e6:.2f} M parameters, {ddp['fp32_params']} in norm and keep_fp32 layers (gathered in fp32)")
    return 0 if fsdp["train_state_mb"] <= 0.6 * ddp["train_state_mb"] and ratio <= 0.6 else 1


def parallel_case(pipeline: Pipeline) -> dict | None:
    """2-rank fit on synthetic batches (this process is one rank); rank 0 returns the figures."""
    from stack.synthetic_batch import random_batch
    from stack.train.datamodule import ResumableLoader
    from stack.train.fit import fit

    def loaders(split: str, rank: int, world: int):
        def epoch(index: int):
            return (random_batch(pipeline, pipeline.data.batch_size, seed=rank * 100 + i) for i in range(8))
        return ResumableLoader(epoch, 8 if split == "train" else 1)

    from stack.train.parallel import fp32_modules

    module, trainer, stats = fit(pipeline, None, loaders, progress=False)
    last = stats.history[-1]
    return {"train_state_mb": last["perf/train_state_mb"], "peak_memory_mb": last["perf/peak_memory_mb"],
            "step_ms": last["perf/step_ms"], "rank": trainer.global_rank, "comm": last["comm"],
            "wire_mb": last.get("perf/comm_wire_mb"), "retransmitted_mb": last.get("perf/comm_retransmitted_mb"),
            "params": sum(p.numel() for p in module.model.parameters()),
            "fp32_params": sum(p.numel() for m in fp32_modules(module.model) for p in m.parameters())
            } if trainer.is_global_zero else None


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    from stack.config import load_pipeline

    parser = argparse.ArgumentParser(prog="python -m stack.train.bench")
    parser.add_argument("mode", choices=("parallel",))
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
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
