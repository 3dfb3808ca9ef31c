"""Bench-only code: the baselines `stack bench` times the product against, and one-off lab scripts; no bench.

This folder is not installed (setup.py maps only the stage folders into `stack`), so nothing here
ships to users. `stack.bench_only.load(name)` imports a module of it from a source checkout (an
editable install); installed from a wheel, the benchmark rows that need it say so and are skipped.

- `raycast_reference`: the world renderer as it was before all cameras were cast at once, camera by camera; the
  oracle of tests/data/test_render_equality.py and the baseline of the renderer rows of `stack bench data`.
- `render_side_by_side`: both renderers on the same frames, interleaved, in CPU seconds.
- `bev_pool_v1` (+ `csrc/bev_pool_cpu_v1.cpp`): the previous CPU kernels of `stack::bev_pool`, compiled on
  first use into a library of their own, timed beside the current ones by `stack bench ops`.
- `instructions/<level>.json`: the instruction-count baselines `stack bench instructions --check` judges against.

The other modules are lab scripts, run by hand (`python benchmarks/NAME.py ...`, usage in each docstring), each
answering one question a docs/log entry records (`label_ambiguity`, `standstill_labels`, `guard_overrides`,
`guard_class_scores`, `motion_probe`, `previous_heading`, `loader_profile`, `dali_history_graph`, `clip_loaders`,
`render_isa`, `clip_sheet`; docs/log/README.md indexes the entries). They are not benches: no `stack bench`
row, no record, and so not in the one registry of benches, `stack.commands.bench.BENCHMARKS`.
"""
