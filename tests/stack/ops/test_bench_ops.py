"""`stack bench ops` machinery: the variants it times compute the same grid; the floor is the bytes it names."""

import torch

from stack.config import CONFIG_DIR, load_pipeline
from stack.ops import bench, bev_pool_ref


def tiny_case(batch=1):
    pipeline = load_pipeline([CONFIG_DIR / "pipeline.yaml", CONFIG_DIR / "presets" / "tiny.yaml"],
                             [f"data.batch_size={batch}"])
    return bench.build_case("tiny", pipeline)


def test_naive_variant_matches_the_reference():
    case = tiny_case(batch=2)
    expected = bev_pool_ref(case.depth, case.context, case.geometry)
    torch.testing.assert_close(bench.bev_pool_naive(case), expected, atol=1e-5, rtol=1e-5)
    assert int(case.keep.sum()) == case.geometry.num_points == case.cells.numel()


def test_every_forward_variant_agrees_and_the_report_names_the_floor(tmp_path):
    case = tiny_case()
    expected = bev_pool_ref(case.depth, case.context, case.geometry)
    for name, fn in bench.variants(case, tmp_path).items():
        out = fn()
        if "bwd" in name:
            assert out.shape == case.depth.shape and out.abs().sum() > 0, name
        else:
            out = torch.as_tensor(out[0] if isinstance(out, list) else out)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=name)
    g = case.geometry
    grid_bytes = g.batch * case.context.shape[2] * g.grid_x * g.grid_y * 4
    tables_bytes = 4 * (3 * g.num_points + 2 * g.num_cells)
    assert bench.floor_bytes(case) == case.depth.nbytes + case.context.nbytes + tables_bytes + grid_bytes
    times = {"op stack::bev_pool": ({1: 0.003, "cpu": 0.0025, 2: 0.002}, 0.0),
             "naive (frustum tensor + index_add)": ({1: 0.03, "cpu": 0.025, 2: 0.02}, 0.0)}
    peaks = {"op stack::bev_pool": 2**20, "naive (frustum tensor + index_add)": 10 * 2**20}
    report = bench.format_case(case, times, peaks, bandwidth=1e10)
    assert "| naive (frustum tensor + index_add) | 30.00 | 25.00 | 20.00 | 10.0x | 10.0 | 10.0x |" in report
    assert "CPU time, 1 thread (ms)" in report
    assert "op forward = 11.3x the floor (2 threads, wall), 14.2x (1 thread, CPU time); goal <= 3x: MISSED" in report
    assert "op forward + backward: not measured" in report


def test_the_floor_lines_judge_each_goal_on_the_wall_ratio():
    # The previous kernel's default-preset forward was 5x its floor: a goal of 3x must call that a miss.
    slow, fast = ({2: 0.005, "cpu": 0.009}, 0.0), ({2: 0.0029, "cpu": 0.004}, 0.0)
    assert bench.floor_line("op forward", slow, 0.001, 2, bench.FORWARD_GOAL).endswith("goal <= 3x: MISSED")
    assert bench.floor_line("op forward", fast, 0.001, 2, bench.FORWARD_GOAL) == (
        "op forward = 2.9x the floor (2 threads, wall), 4.0x (1 thread, CPU time); goal <= 3x: met")
    assert bench.floor_line("op forward + backward", ({2: 0.0041, "cpu": 0.01}, 0.0), 0.001, 2,
                            bench.FORWARD_BACKWARD_GOAL).endswith("goal <= 4x: MISSED")
    # The 1-thread CPU time is set against the floor at the 1-thread copy bandwidth (here half the 2-thread one).
    assert ", 2.0x (1 thread, CPU time)" in bench.floor_line("op forward", fast, 0.001, 2, bench.FORWARD_GOAL, 0.002)


def test_the_backward_floor_counts_the_gradient_read_and_both_gradients_written():
    case = tiny_case()
    g = case.geometry
    grad_bytes = g.batch * case.context.shape[2] * g.grid_x * g.grid_y * 4
    assert bench.backward_floor_bytes(case) == (grad_bytes + 4 * 3 * g.num_points
                                                + 2 * (case.depth.nbytes + case.context.nbytes))


def test_the_recorded_figures_keep_every_run_and_the_op_rows_their_floor():
    """`--record` gets every timed run per thread count; the op's rows carry bytes over the copy bandwidth measured
    with as many threads (the 1-thread CPU time against the 1-thread copy), other rows no floor."""
    from stack.benchrecord import FigureLog

    case, log = tiny_case(), FigureLog()
    runs = {"op stack::bev_pool": {1: [0.004, 0.003], "cpu": [0.0025] * 5, 2: [0.002, 0.0021, 0.0025]},
            "naive (frustum tensor + index_add)": {1: [0.03], "cpu": [0.025] * 5, 2: [0.02]}}
    bench.record_figures(log, case, runs, {1: 1e9, "cpu": 1e9, 2: 4e9})
    figures = {figure.name: figure for figure in log.figures}
    op = figures["tiny: op stack::bev_pool, 2 threads"]
    assert op.samples == (0.002, 0.0021, 0.0025) and op.unit == "s" and op.lower_is_better
    assert op.floor == bench.floor_bytes(case) / 4e9
    assert figures["tiny: op stack::bev_pool, CPU time, 1 thread"].floor == bench.floor_bytes(case) / 1e9
    assert figures["tiny: naive (frustum tensor + index_add), 1 thread"].floor is None
    assert len(figures) == 6
