"""Instruction counts of the CPU kernels and the renderer: a performance regression check that holds on a noisy machine.

A timing on our shared 2-core machines moves 10-30% from run to run; the instructions a fixed, single-threaded
workload executes under valgrind's callgrind repeat exactly. `stack bench instructions --check` (`make perf`,
part of `make test`) counts them per stage and per function, with simulated cache misses, and fails when a
stage or one of the project's kernels grew past the baseline stored for its ISA level.

- `workloads`: the fixed workloads (bev_pool's kernels, one frame of the renderer), run inside callgrind;
- `callgrind`: runs them and reads the dumps (per stage, per function);
- `baseline`: the stored baselines (benchmarks/instructions/<level>.json) and the verdict;
- `bench`: the `stack bench instructions` command.

The approach is CodSpeed's (instruction counts under a CPU simulator for CI, docs.codspeed.io) on valgrind's
callgrind (valgrind.org/docs/manual/cl-manual.html).
"""
