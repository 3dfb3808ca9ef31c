"""`stack bench ops-cuda` and `stack bench train-step-cuda`: a clear refusal without a GPU, the datasheet
bandwidth they print, and (with a GPU) figures recorded with their DRAM floor."""

import pytest
import torch

from stack.benchrecord import FigureLog
from stack.cli import main
from stack.config import CONFIG_DIR, load_pipeline
from stack.ops import bench
from stack.ops import bev_pool_cuda_bench as bench_cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmarks run instead")
@pytest.mark.parametrize("name, on_cpu", [("ops-cuda", "ops"), ("train-step-cuda", "train-step")])
def test_without_a_gpu_the_cuda_benchmarks_say_what_they_need(name, on_cpu, capsys):
    assert main(["bench", name]) == 2
    err = capsys.readouterr().err
    assert "torch sees none" in err and f"run `stack bench {on_cpu}`" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the profiled pass runs instead")
def test_the_profiled_pass_for_ncu_says_what_it_needs(capsys):
    assert bench_cuda.main([]) == 2
    assert "torch sees none" in capsys.readouterr().err
    assert bench_cuda.main(["huge"]) == 2
    assert "no preset 'huge'" in capsys.readouterr().err


def test_datasheet_bandwidth_tells_the_pcie_h100_from_the_sxm():
    assert bench_cuda.datasheet_bandwidth("NVIDIA H100 80GB HBM3") == ("H100", 3.35e12)
    assert bench_cuda.datasheet_bandwidth("NVIDIA H100 PCIe") == ("H100 PCIe", 2.0e12)
    assert bench_cuda.datasheet_bandwidth("Some Future GPU") is None


@pytest.mark.gpu
def test_each_variant_is_recorded_cold_and_warm_against_its_floor():
    pipeline = load_pipeline([CONFIG_DIR / "pipeline.yaml", CONFIG_DIR / "presets" / "tiny.yaml"],
                             ["data.batch_size=1"])
    device = torch.device("cuda", 0)
    case = bench_cuda.to_device(bench.build_case("tiny", pipeline), device, torch.float32)
    figures, lines = FigureLog(), []
    rows = bench_cuda.measure_case(case, bench_cuda.L2Flush(device), 1e12, figures, lines.append)
    assert len(rows) == 4 and all(row.startswith("| tiny | float32 |") for row in rows)
    recorded = {figure.name: figure for figure in figures.figures}
    assert len(recorded) == 8
    forward = recorded["tiny float32: op stack::bev_pool, cold L2"]
    assert forward.floor == pytest.approx(bench.floor_bytes(case) / 1e12)
    assert len(forward.samples) == bench_cuda.RUNS and min(forward.samples) > 0
