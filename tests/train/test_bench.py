"""`stack bench train-step`: the floor column never reports a bound the step already beats."""

from stack.train.bench import floor_cell


def test_floor_cell_prints_the_bound_when_the_step_is_above_it():
    row = {"gflop": 50.6, "peak_tflops": 0.16, "floor_ms": 50.6 / 0.16, "step_ms": 858.0}
    assert floor_cell(row) == "316 (50.6 GFLOP / 0.16 TFLOP/s)"


def test_floor_cell_refuses_a_bound_slower_than_the_measured_step():
    # bf16 on a CPU without bf16 instructions: the matmul probe crawls, the convolutions do not.
    row = {"gflop": 50.6, "peak_tflops": 0.0014, "floor_ms": 50.6 / 0.0014, "step_ms": 8642.0}
    cell = floor_cell(row)
    assert cell.startswith("none")
    assert "slower than the step" in cell and "0.0014 TFLOP/s" in cell
