"""The latency model: predicted latency on a target that is not here, with its stated error.

- `roofline`: a per-layer roofline over the ONNX graph (FLOPs over the target's peak, bytes over its
  bandwidth, each scaled by a fitted efficiency), and the gate margin the model's error gives.
- `references`: published Jetson Orin timings (MLPerf, Ultralytics YOLO11, CUDA-BEVFusion, CUDA-PointPillars,
  BEVDet-TensorRT) it is fitted to and checked against.
- `efficiency_fit`: the least-squares fit of the efficiencies to those references and its leave-one-out error.
- `networks`: the reference networks rebuilt from their architecture definitions (random weights, cached
  graphs), so each reference's graph is the one the model predicts.

`stack bench latency` prints the fit, every reference's error and the predictions per target.
"""
