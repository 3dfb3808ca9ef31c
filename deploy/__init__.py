"""stack.deploy: from a trained checkpoint to a bundle that passed its target's gates.

Read in the order `stack deploy` runs (`orchestrate`):

- export: `exportable` (the checkpoint's network fixed to one camera `calibration`), `export` (ONNX,
  checked against PyTorch);
- quantize: `validation` (calibration, sensitivity and scoring samples), `quantize` (INT8 QDQ in the
  target's flavour);
- gates: `gates/` (accuracy per head, FPS measured or predicted by `latency/`, closed loop);
- bundle: `bundle` (built aside, swapped in whole, sha256 per file), `report`;
- engine and runtimes: `tensorrt` (+ `trt_ops`), `runtime` (ONNX Runtime timing), `ort_profile`,
  `runner` (`DeployedNetwork`: how a bundle is run), `network_policies` (a checkpoint or a bundle driving `stack.sim`).

`entrypoints` is what `stack export` / `stack deploy` call; `bench` holds `stack bench infer`, `latency`
and `drive`.
"""
