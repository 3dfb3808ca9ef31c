"""DDP and FSDP2 on 2 CPU processes (gloo), launched by Lightning exactly as `stack train` does.

FSDP2 runs as torchtitan checks it: the loss curve of FSDP2 equals DDP's from the same
seed (to 1e-4 in fp32 and 1e-3 in bf16-mixed: FSDP2's bf16 gather rounds each weight as
DDP's autocast cast does, and on gloo the curves agree to 6 digits; NCCL's reduction order
may differ), bf16-mixed all-gathers bf16 parameters and reduces fp32
gradients (measured at the collectives) on a CPU with bf16 instructions and trains in fp32, saying why, on one
without (test_bf16_fsdp2_gathers_bf16_reduces_fp32_and_matches_ddp), and HSDP meshes 1x2 (pure sharding) and 2x1
(pure replication) hold the training state each mesh implies."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "run_tiny.py"
REPO = Path(__file__).resolve().parents[2]
COMMON = ["train.devices=2", "train.max_steps=4", "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=2",
          "train.seed=3", "train.count_comm_bytes=true"]  # the comm tests read perf/comm_sent_mb


def train(out: Path, *overrides: str, batches: int = 6, nan_at: int = -1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--batches", str(batches), "--nan-at", str(nan_at),
                           f"train.out_dir={out}", *COMMON, *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def curve(out: Path) -> list[float]:
    with open(out / "csv" / "metrics.csv") as handle:
        return [float(r["train/loss_total"]) for r in csv.DictReader(handle) if r.get("train/loss_total")]


def summaries(out: Path) -> list[dict]:
    return [json.loads((out / f"summary-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    result = train(out, "train.strategy=ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    result = train(out, "train.strategy=fsdp", *FSDP_UNITS)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


FSDP_UNITS = ["train.fsdp_units=[backbone.*.*,planning_head]", "train.activation_checkpointing=[backbone.*]"]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """(DDP, FSDP2) runs under bf16-mixed, otherwise as ddp_run / fsdp_run."""
    outs = []
    for strategy in ("ddp", "fsdp"):
        out = tmp_path_factory.mktemp(f"{strategy}-bf16")
        result = train(out, f"train.strategy={strategy}", "train.precision=bf16-mixed",
                       *(FSDP_UNITS if strategy == "fsdp" else []))
        assert result.returncode == 0, result.stderr[-3000:]
        (out / "stderr.txt").write_text(result.stderr)  # what the run said about its precision
        outs.append(out)
    return outs


def comm(out: Path, rank: int = 0) -> dict:
    """The bytes `rank` sent per step in the last window, by collective and dtype."""
    return summaries(out)[rank]["stats"][-1]["comm"]


@pytest.mark.slow
def test_ddp_runs_two_ranks_in_step(ddp_run):
    ranks = summaries(ddp_run)
    assert [s["world_size"] for s in ranks] == [2, 2] and [s["global_step"] for s in ranks] == [4, 4]
    assert [s["loaders"] for s in ranks] == [[["train", 0, 2], ["val", 0, 2]], [["train", 1, 2], ["val", 1, 2]]]
    assert (ddp_run / "checkpoints" / "step-0000004.ckpt" / ".metadata").is_file() and (ddp_run / "model.pt").is_file()


@pytest.mark.slow
def test_fsdp2_matches_ddp_with_sharded_state(ddp_run, fsdp_run):
    ranks = summaries(fsdp_run)
    assert ranks[0]["sharded_units"] == ["backbone.0.0", "backbone.0.1", "backbone.1.0", "backbone.1.1",
                                         "planning_head"]
    assert ranks[0]["checkpointed_units"] == ["backbone.0", "backbone.1"]
    # Same data, same seed: data parallelism sharded or replicated gives the same training.
    assert curve(fsdp_run) == pytest.approx(curve(ddp_run), rel=1e-4)
    # Each rank holds about half of parameters + gradients + AdamW state.
    fsdp_mb = max(s["stats"][-1]["perf/train_state_mb"] for s in ranks)
    ddp_mb = max(s["stats"][-1]["perf/train_state_mb"] for s in summaries(ddp_run))
    assert fsdp_mb <= 0.6 * ddp_mb
    shards = sorted(p.name for p in (fsdp_run / "checkpoints" / "step-0000004.ckpt").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


@pytest.mark.slow
def test_fsdp2_resumes_from_its_sharded_checkpoint(fsdp_run, tmp_path):
    result = train(tmp_path, "train.strategy=fsdp", "train.fsdp_units=[backbone.*.*,planning_head]",
                   "train.activation_checkpointing=[backbone.*]", f"train.resume={fsdp_run}/checkpoints/step-0000002.ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert curve(tmp_path) == pytest.approx(curve(fsdp_run)[2:], rel=1e-5)


@pytest.mark.slow
def test_divergence_on_one_rank_stops_both_with_the_step(tmp_path):
    # Rank 0's third batch carries a NaN label: both ranks stop together (no hang) at step 2.
    result = train(tmp_path, "train.strategy=ddp", nan_at=2)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "training diverged at step 2: loss term depth=nan" in result.stderr
    assert "Last good checkpoint: " in result.stderr and "step-0000002.ckpt" in result.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000002.ckpt"


def _trained_in(out: Path) -> str:
    """The precision a run trained in, as its pipeline.yaml records it."""
    from omegaconf import OmegaConf

    return OmegaConf.load(out / "pipeline.yaml").train.precision


@pytest.mark.slow
def test_bf16_fsdp2_gathers_bf16_reduces_fp32_and_matches_ddp(fsdp_run, bf16_runs):
    """What bf16-mixed promises on this CPU. With bf16 matrix instructions (as PyTorch may use them here:
    `cpu_has_fast_bf16`), FSDP2 gathers bf16 and reduces fp32 and matches DDP in bf16; without (an AVX2-only EPYC,
    or one emulated with ONEDNN_MAX_CPU_ISA=AVX2), both runs train in fp32 exactly as the fp32 run, say why, and
    record 32-true."""
    from stack.train.precision import cpu_has_fast_bf16

    ddp_bf16, fsdp_bf16 = bf16_runs
    # torchtitan's convergence check: same seed and data, same curve (within bf16 rounding).
    assert curve(fsdp_bf16) == pytest.approx(curve(ddp_bf16), rel=1e-3)
    fp32, bf16 = comm(fsdp_run), comm(fsdp_bf16)
    assert set(fp32) >= {"all_gather/float32", "reduce_scatter/float32"} and "all_gather/bfloat16" not in fp32
    # Gradients are reduced in fp32 either way; DDP all-reduces every fp32 gradient: twice the bytes a rank sends
    # in a reduce-scatter of them.
    assert "reduce_scatter/bfloat16" not in bf16
    assert bf16["reduce_scatter/float32"]["payload_mb"] == pytest.approx(fp32["reduce_scatter/float32"]["payload_mb"])
    assert comm(ddp_bf16)["all_reduce/float32"]["sent_mb"] >= 1.9 * bf16["reduce_scatter/float32"]["sent_mb"]
    said = [(out / "stderr.txt").read_text() for out in bf16_runs]
    if cpu_has_fast_bf16():
        assert [_trained_in(out) for out in bf16_runs] == ["bf16-mixed", "bf16-mixed"]
        assert [text.count("; training in bf16-mixed.") for text in said] == [1, 1], said  # once, by rank 0
        assert curve(fsdp_bf16) != pytest.approx(curve(fsdp_run), rel=1e-6), "bf16-mixed trained in fp32"
        # Parameters gathered in bf16 (the norm layers' few stay fp32).
        gathered = {dtype: bf16.get(f"all_gather/{dtype}", {}).get("payload_mb", 0) for dtype in ("bfloat16", "float32")}
        assert gathered["bfloat16"] > 5 * gathered["float32"]
        assert sum(gathered.values()) < 0.6 * fp32["all_gather/float32"]["payload_mb"]
    else:
        # fp32 throughout, said once per run (by rank 0): the same curve and collectives as the fp32 run.
        assert [_trained_in(out) for out in bf16_runs] == ["32-true", "32-true"]
        assert [text.count("; training in 32-true") for text in said] == [1, 1], said
        assert curve(fsdp_bf16) == pytest.approx(curve(fsdp_run), rel=1e-6)
        assert "all_gather/bfloat16" not in bf16
        assert bf16["all_gather/float32"]["payload_mb"] == pytest.approx(fp32["all_gather/float32"]["payload_mb"])


@pytest.mark.slow
def test_hsdp_meshes_1x2_shard_and_2x1_replicate(ddp_run, fsdp_run, tmp_path):
    replicated = tmp_path / "2x1"
    result = train(replicated, "train.strategy=fsdp", "train.fsdp_replicate=2", *FSDP_UNITS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert curve(replicated) == pytest.approx(curve(ddp_run), rel=1e-4)
    state = {name: max(s["stats"][-1]["perf/train_state_mb"] for s in summaries(out))
             for name, out in (("ddp", ddp_run), ("1x2", fsdp_run), ("2x1", replicated))}
    assert state["2x1"] == pytest.approx(state["ddp"], rel=0.02), state  # every rank holds everything
    assert state["1x2"] <= 0.6 * state["2x1"], state  # each rank holds about half
    # 2x1: the shard groups are single ranks (FSDP2 issues no gather), gradients all-reduced
    # across the two replicas; 1x2: parameters gathered and gradients reduce-scattered between the ranks.
    two_by_one, one_by_two = comm(replicated), comm(fsdp_run)
    assert "all_gather/float32" not in two_by_one and two_by_one["all_reduce/float32"]["sent_mb"] > 0
    assert one_by_two["all_gather/float32"]["sent_mb"] > 0 and one_by_two["reduce_scatter/float32"]["sent_mb"] > 0


def test_cpu_offload_is_refused_on_cpu_ranks(tmp_path):
    result = train(tmp_path, "train.strategy=fsdp", "train.fsdp_cpu_offload=true")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train.fsdp_cpu_offload=true needs train.strategy=fsdp on GPUs" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "checkpoints").exists()



@pytest.mark.slow
@pytest.mark.serial
def test_bytes_counted_at_the_collectives_are_the_bytes_on_the_wire(ddp_run, fsdp_run):
    """What the trainer logs as sent (`perf/comm_sent_mb`, counted at the calls under the ring algorithm) is what
    the kernel saw leave each rank over TCP (`perf/comm_wire_mb`, each byte once: a segment the kernel sent
    again, as its tail loss probe does when a busy core ACKs late, is `perf/comm_retransmitted_mb`; seen once,
    20 KiB in a step, 2026-11-28), plus gloo's own messages (measured: 0.4-1.1 KiB a call; 2 KiB allowed): DDP's
    all-reduce as counted; FSDP2's all-gathers as counted and its reduce-scatters at an all-reduce's bytes, twice
    the ring figure, because gloo's reduce-scatter reduces the whole tensor on every rank (NCCL's is a ring: the
    count is its floor). The first step is judged: later windows also carry the background
    write of the checkpoint before them (its own process group)."""
    for rank in (0, 1):
        ddp = summaries(ddp_run)[rank]["stats"][0]
        headers = _calls(ddp) * 2048 / 2**20
        assert 0 <= ddp["perf/comm_wire_mb"] - ddp["perf/comm_sent_mb"] <= headers, ddp
        assert "perf/comm_retransmitted_mb" in ddp, ddp
        fsdp = summaries(fsdp_run)[rank]["stats"][0]
        reduced = sum(v["sent_mb"] for k, v in fsdp["comm"].items() if k.startswith("reduce_scatter/"))
        assert reduced > 0.1 * fsdp["perf/comm_sent_mb"], fsdp["comm"]
        headers = _calls(fsdp) * 2048 / 2**20
        assert 0 <= fsdp["perf/comm_wire_mb"] - (fsdp["perf/comm_sent_mb"] + reduced) <= headers, fsdp


def _calls(stats: dict) -> float:
    return sum(value["calls"] for value in stats["comm"].values())
