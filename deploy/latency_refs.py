"""Published Jetson AGX Orin timings the latency model is fitted to and checked against.

Each reference names the network (rebuilt here from torchvision with random weights:
latency does not depend on the weights' values), its input, the precision of the
published engine, the published latency and where it comes from. `fit_efficiency`
scales the compute and memory efficiencies together (their ratio and the launch
overhead held at their priors: one published point cannot pin more than one number)
to the value that best explains them (least squares in log space), and `errors` reports
the model's relative error per reference.

One reference is fitted (MLPerf's ResNet-50, so its error is ~0 by construction) and
one is held out to validate: CUDA-BEVFusion's camera backbone at 6x256x704, the workload
closest to this stack's, rebuilt here from BEVFusion's configs. Its error, printed by
`stack bench latency` and recorded in BENCHMARKS.md, is the model's stated error. Each
further published figure is one line in REFERENCES.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from stack.deploy.latency import Efficiency, predict


@dataclass(frozen=True)
class Reference:
    name: str
    builder: str
    """torchvision.models function name."""
    input_shape: tuple
    precision: str
    """`int8` (fully INT8 engine) or `fp16`."""
    latency_ms: float
    source: str
    fitted: bool = True
    """True: the efficiency factors are fitted to it; False: held out to validate the fit."""


REFERENCES = (
    Reference("ResNet-50 v1.5, 224x224, batch 1", "resnet50", (1, 3, 224, 224), "int8", 0.64,
              "MLPerf Inference v3.1 Edge (closed), NVIDIA Jetson AGX Orin 64G, TensorRT 8.6, GPU, "
              "ResNet-50 SingleStream 90th-percentile latency; https://mlcommons.org/benchmarks/inference-edge/"),
    Reference("CUDA-BEVFusion camera backbone (ResNet-50 + LSS-FPN + depth net), 6x3x256x704", "bevfusion_camera",
              (6, 3, 256, 704), "int8", 12.73,
              "NVIDIA-AI-IOT/Lidar_AI_Solution issue #175: CUDA-BEVFusion resnet50int8 'Camera Backbone' on "
              "Jetson AGX Orin, steady state 12.7-14.4 ms (user-measured, TensorRT 8.x); the best value is used",
              fitted=False),
)


def reference_onnx(reference: Reference, folder: Path) -> onnx.ModelProto:
    """The reference network exported to ONNX (random weights, eval mode, BN folded)."""
    import torch
    import torchvision

    from stack.deploy.export import export_onnx

    torch.manual_seed(0)
    if reference.builder == "bevfusion_camera":
        net = _BevFusionCamera().eval()
    else:
        net = getattr(torchvision.models, reference.builder)(weights=None).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, images):
            return {"logits": self.net(images)}

    path = folder / f"{reference.builder}.onnx"
    export_onnx(Wrapped(), {"images": torch.zeros(reference.input_shape)}, ["logits"], path, opset=17, metadata={})
    return onnx.load(str(path))


def _BevFusionCamera():
    """ResNet-50 trunk + BEVFusion's GeneralizedLSSFPN (C3-C5 -> 256 at stride 8) + its depth net
    (two 3x3 convs, then 118 depth bins + 80 context channels): the graph CUDA-BEVFusion times
    as "Camera Backbone", rebuilt from the BEVFusion configs (random weights)."""
    import torch
    import torchvision
    from torch import nn

    def block(cin, cout, k):
        return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    class Camera(nn.Module):
        def __init__(self):
            super().__init__()
            trunk = torchvision.models.resnet50(weights=None)
            self.stem = nn.Sequential(trunk.conv1, trunk.bn1, trunk.relu, trunk.maxpool, trunk.layer1, trunk.layer2)
            self.layer3, self.layer4 = trunk.layer3, trunk.layer4
            self.lateral4, self.fpn4 = block(1024 + 2048, 256, 1), block(256, 256, 3)
            self.lateral3, self.fpn3 = block(512 + 256, 256, 1), block(256, 256, 3)
            self.depthnet = nn.Sequential(block(256, 256, 3), block(256, 256, 3), nn.Conv2d(256, 118 + 80, 1))

        def forward(self, images):
            c3 = self.stem(images)
            c4 = self.layer3(c3)
            c5 = self.layer4(c4)
            up = nn.functional.interpolate(c5, size=c4.shape[-2:], mode="bilinear", align_corners=False)
            p4 = self.fpn4(self.lateral4(torch.cat([c4, up], 1)))
            up = nn.functional.interpolate(p4, size=c3.shape[-2:], mode="bilinear", align_corners=False)
            p3 = self.fpn3(self.lateral3(torch.cat([c3, up], 1)))
            return self.depthnet(p3)

    return Camera()


def predictions(target, efficiency: Efficiency, models: dict | None = None) -> list[tuple[Reference, float]]:
    """(reference, predicted ms) for every reference on `target` (the AGX Orin target)."""
    models = models if models is not None else load_models()
    out = []
    for reference in REFERENCES:
        precise = replace(target, precision="fp16") if reference.precision == "fp16" else target
        prediction = predict(models[reference.builder], precise, efficiency=efficiency,
                             all_int8=reference.precision == "int8")
        out.append((reference, prediction.total_ms))
    return out


def load_models() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        return {builder: reference_onnx(next(r for r in REFERENCES if r.builder == builder), Path(folder))
                for builder in sorted({r.builder for r in REFERENCES})}


PRIOR = Efficiency(compute=0.5, memory=0.7, launch_us=4.0)
"""Before fitting: dense INT8/FP16 tensor-core convs at batch 1 reach about half of peak,
streaming kernels about 70% of DRAM bandwidth, and each kernel costs a few microseconds."""


def fit_efficiency(target, prior: Efficiency = PRIOR, models: dict | None = None) -> Efficiency:
    """`prior` with both efficiencies scaled by the factor that minimises the log error over REFERENCES."""
    models = models if models is not None else load_models()
    grid = np.linspace(0.1, min(1.0 / prior.compute, 1.0 / prior.memory), 120)
    scores = []
    for value in grid:
        candidate = replace(prior, compute=prior.compute * float(value), memory=prior.memory * float(value))
        logs = [np.log(predicted / ref.latency_ms) for ref, predicted in predictions(target, candidate, models)
                if ref.fitted]
        scores.append(float(np.mean(np.square(logs))))
    best = float(grid[int(np.argmin(scores))])
    return replace(prior, compute=round(prior.compute * best, 3), memory=round(prior.memory * best, 3))


def errors(target, efficiency: Efficiency, models: dict | None = None) -> list[dict]:
    """Relative error of the model per reference: (predicted - published) / published."""
    return [{"reference": ref.name, "precision": ref.precision, "published_ms": ref.latency_ms,
             "role": "fitted" if ref.fitted else "held out",
             "predicted_ms": round(predicted, 3), "error": round((predicted - ref.latency_ms) / ref.latency_ms, 3),
             "source": ref.source} for ref, predicted in predictions(target, efficiency, models)]
