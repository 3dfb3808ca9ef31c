"""The published reference networks of the latency model, rebuilt from their architecture definitions.

Latency depends on shapes, not weight values, so every network is built with random weights,
exported once to ONNX and cached with its large weight tensors stripped (dims kept, data
dropped: the latency model reads only shapes). The cache lives in `$STACK_CACHE_DIR/latency-refs`
(default `~/.cache/stack/latency-refs`), never in git; a missing entry is built on demand.

- `resnet50`: torchvision's ResNet-50 v1.5 (MLPerf Inference's reference network).
- `yolo11{n,s,m,l,x}`: Ultralytics YOLO11 detection models at 640x640, reproduced block by block
  from `ultralytics/cfg/models/11/yolo11.yaml` and `ultralytics/nn/modules` (Conv, C3k2, C3k,
  Bottleneck, SPPF, C2PSA/PSABlock/Attention, Detect with DFL decoding). Their parameter counts
  equal Ultralytics' own builds (`YOLO11_PARAMETERS`, checked by the tests) and, exported the same way,
  Ultralytics' own graph has the same FLOPs and a predicted latency within 2%
  (docs/log/2026-11-25_latency-model-fit.md): the graph is the one the published Jetson tables timed
  (Ultralytics exports the box decoding into the engine).
- `bevfusion_camera`: CUDA-BEVFusion's "Camera Backbone" engine: ResNet-50 + GeneralizedLSSFPN +
  lidar-depth encoder + depth net at 6x256x704 (BEVFusion's ResNet-50 config).
- `pointpillars`: CUDA-PointPillars' TensorRT engine (OpenPCDet's KITTI `pointpillar.yaml`): the pillar
  feature net on MAX_VOXELS = 40000 pillars of 32 points, the PillarScatter plugin's scatter into the
  64 x 496 x 432 BEV canvas, BaseBEVBackbone and the single anchor head.
- `bert_large`: BERT-Large with its SQuAD span head at sequence 384, the network of MLPerf Inference's
  BERT-99 benchmark (24 layers, hidden 1024, 16 heads, FFN 4096).
- `bevdet_bev_pool`: the BEVPoolv2 kernel bevdet-tensorrt-cpp times as "BEV pool", written directly as an
  ONNX graph (`GRAPHS`: a cost description of a CUDA kernel, not a network to export).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

import onnx

NETS_VERSION = 2
"""Part of every cache file name: bump when a network definition changes."""
STRIP_ABOVE = 4096
"""Initializers with more elements than this lose their data in the cache (shape arithmetic keeps its constants)."""

YOLO11_SCALES = {"n": (0.50, 0.25, 1024), "s": (0.50, 0.50, 1024), "m": (0.50, 1.00, 512),
                 "l": (1.00, 1.00, 512), "x": (1.00, 1.50, 512)}
"""(depth, width, max channels) per scale, from yolo11.yaml."""
YOLO11_PARAMETERS = {"n": 2_624_080, "s": 9_458_752, "m": 20_114_688, "l": 25_372_160, "x": 56_966_176}
"""Parameter counts of `ultralytics.nn.tasks.DetectionModel("yolo11?.yaml")` (ultralytics 8.4.190, nc=80)."""


def cache_dir() -> Path:
    return Path(os.environ.get("STACK_CACHE_DIR", Path.home() / ".cache" / "stack")) / "latency-refs"


def reference_graph(builder: str, input_shape: tuple, log=None) -> onnx.ModelProto:
    """The reference network `builder` at `input_shape` as a weight-stripped ONNX graph (cached)."""
    shape_tag = "x".join(str(d) for d in input_shape)
    path = cache_dir() / f"{builder}-{shape_tag}-v{NETS_VERSION}.onnx"
    if not path.exists():
        (log or _stderr)(f"building the {builder} reference graph at {shape_tag} (once; cached in {path.parent})")
        if builder in GRAPHS:
            _save(GRAPHS[builder](input_shape), path)
        else:
            _export(build_network(builder), input_shape, path)
    return onnx.load(str(path))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_network(builder: str):
    import torch
    import torchvision

    torch.manual_seed(0)
    if builder.startswith("yolo11"):
        return Yolo11(builder[-1]).eval()
    if builder == "bevfusion_camera":
        return _bevfusion_camera().eval()
    if builder == "pointpillars":
        return _pointpillars().eval()
    if builder == "bert_large":
        return _bert().eval()
    return getattr(torchvision.models, builder)(weights=None).eval()


def _export(net, input_shape: tuple, path: Path) -> None:
    import torch

    from stack.deploy.export import export_onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        raw = Path(folder) / "raw.onnx"
        export_onnx(_Named(net), {"images": torch.zeros(input_shape)}, ["out"], raw, opset=17, metadata={})
        _save(onnx.load(str(raw)), path)


def _save(model: onnx.ModelProto, path: Path) -> None:
    """`model` with its large initializers' data dropped, written to `path` in one rename."""
    for tensor in model.graph.initializer:
        if math.prod(tensor.dims) > STRIP_ABOVE:
            for data in ("raw_data", "float_data", "int32_data", "int64_data"):
                tensor.ClearField(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        staged = Path(folder) / "stripped.onnx"
        onnx.save(model, str(staged))
        os.replace(staged, path)


def _Named(net):
    import torch

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, images):
            return {"out": self.net(images)}

    return Named()


def _bevfusion_camera():
    """The graph CUDA-BEVFusion times as "Camera Backbone" (inputs: six images and their lidar depth maps),
    rebuilt from BEVFusion's ResNet-50 config: ResNet-50 trunk, GeneralizedLSSFPN (C3-C5 -> 256 at stride 8),
    DepthLSSTransform's depth encoder (dtransform: 1 -> 8 -> 32 -> 64 channels down to stride 8) and depth
    net (two 3x3 convs, then 118 depth bins + 80 context channels), depth softmax in the engine."""
    import torch
    import torchvision
    from torch import nn

    def block(cin, cout, k, stride=1):
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU())

    class Camera(nn.Module):
        def __init__(self):
            super().__init__()
            trunk = torchvision.models.resnet50(weights=None)
            self.stem = nn.Sequential(trunk.conv1, trunk.bn1, trunk.relu, trunk.maxpool, trunk.layer1, trunk.layer2)
            self.layer3, self.layer4 = trunk.layer3, trunk.layer4
            self.lateral4, self.fpn4 = block(1024 + 2048, 256, 1), block(256, 256, 3)
            self.lateral3, self.fpn3 = block(512 + 256, 256, 1), block(256, 256, 3)
            self.dtransform = nn.Sequential(block(1, 8, 1), block(8, 32, 5, 4), block(32, 64, 5, 2))
            self.depthnet = nn.Sequential(block(256 + 64, 256, 3), block(256, 256, 3), nn.Conv2d(256, 118 + 80, 1))

        def forward(self, images):
            depth = images[:, :1]  # the lidar depth map input, same size as the image
            c3 = self.stem(images)
            c4 = self.layer3(c3)
            c5 = self.layer4(c4)
            up = nn.functional.interpolate(c5, size=c4.shape[-2:], mode="bilinear", align_corners=False)
            p4 = self.fpn4(self.lateral4(torch.cat([c4, up], 1)))
            up = nn.functional.interpolate(p4, size=c3.shape[-2:], mode="bilinear", align_corners=False)
            p3 = self.fpn3(self.lateral3(torch.cat([c3, up], 1)))
            out = self.depthnet(torch.cat([p3, self.dtransform(depth)], 1))
            return torch.cat([out[:, :118].softmax(1), out[:, 118:]], 1)

    return Camera()


POINTPILLARS_GRID = (496, 432)
"""BEV canvas (y, x) of OpenPCDet's KITTI PointPillars: range [0, 69.12] x [-39.68, 39.68] m at 0.16 m."""


def _pointpillars():
    """The graph CUDA-PointPillars' engine runs ("Inference" in its README's table; voxelization, feature
    generation and post-processing are timed apart): input (1, 40000, 32, 10), every pillar slot of MAX_VOXELS
    (the engine's shape is fixed), 10 features per point (x, y, z, intensity, offsets to the pillar's mean and
    centre). PillarVFE: Linear 10 -> 64 with its BatchNorm folded, ReLU, max over the 32 points. PillarScatter:
    each pillar's 64 features written at its cell of the 64 x 496 x 432 canvas (in CUDA-PointPillars one plugin
    does the max and the scatter, `tool/simplifier_onnx.py`; ScatterElements here; the cells are a fixed random
    draw, their count is what costs). BaseBEVBackbone: three levels of
    [3, 5, 5] extra 3x3 convs after a stride-2 3x3 conv, [64, 128, 256] channels, each deconvolved to 128 at
    stride 2 (kernel = stride: 1, 2, 4), concatenated. AnchorHeadSingle: 1x1 convs to 3 classes x 2 rotations
    (18), 7 box terms x 6 anchors (42) and 2 direction bins x 6 (12)."""
    import torch
    from torch import nn

    def conv(cin, cout, stride=1):
        return [nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False), nn.BatchNorm2d(cout, eps=1e-3), nn.ReLU()]

    def deconv(cin, cout, stride):
        return nn.Sequential(nn.ConvTranspose2d(cin, cout, stride, stride, bias=False), nn.BatchNorm2d(cout, eps=1e-3),
                             nn.ReLU())

    class PointPillars(nn.Module):
        def __init__(self, pillars=40000):
            super().__init__()
            self.linear = nn.Linear(10, 64)
            cells = POINTPILLARS_GRID[0] * POINTPILLARS_GRID[1]
            self.register_buffer("cells", torch.randperm(cells, generator=torch.Generator().manual_seed(0))[:pillars])
            channels, self.levels = 64, nn.ModuleList()
            for layers, width in zip((3, 5, 5), (64, 128, 256)):
                self.levels.append(nn.Sequential(*conv(channels, width, 2), *sum((conv(width, width) for _ in
                                                                                  range(layers)), [])))
                channels = width
            self.deblocks = nn.ModuleList(deconv(width, 128, stride) for width, stride in ((64, 1), (128, 2), (256, 4)))
            self.cls, self.box, self.dir = nn.Conv2d(384, 18, 1), nn.Conv2d(384, 42, 1), nn.Conv2d(384, 12, 1)

        def forward(self, voxels):
            # BatchNorm after the bias-free linear is one affine map in eval mode: folded here, as TensorRT fuses
            # it into the matmul's epilogue with the ReLU. The max over points then reads what the matmul wrote.
            x = torch.relu(self.linear(voxels.squeeze(0)))                       # (pillars, 32, 64)
            pillars = x.amax(dim=1).t()                                          # (64, pillars)
            canvas = voxels.new_zeros(64, POINTPILLARS_GRID[0] * POINTPILLARS_GRID[1])
            canvas = canvas.scatter(1, self.cells.expand(64, -1), pillars)
            x = canvas.reshape(1, 64, *POINTPILLARS_GRID)
            ups = []
            for level, deblock in zip(self.levels, self.deblocks):
                x = level(x)
                ups.append(deblock(x))
            x = torch.cat(ups, 1)
            return torch.cat([self.cls(x), self.box(x), self.dir(x)], 1)

    return PointPillars()


def _bert(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522, seq=384):
    """BERT-Large (Devlin et al. 2019, https://arxiv.org/abs/1810.04805) with the SQuAD span head (1024 -> 2),
    as MLPerf Inference's BERT-99 runs it on one 384-token window: input (1, 384) token ids (a float tensor,
    cast: `reference_graph` feeds zeros). Word-embedding Gather plus one constant (position + segment) table,
    LayerNorm; per layer Q/K/V projections, softmax(Q K^T / 8) V over 16 heads of 64, output projection + residual,
    LayerNorm, FFN 1024 -> 4096 -> 1024 with erf GELU, residual, LayerNorm (post-LN, eps 1e-12), all as exported
    from PyTorch. 24 x 12.6M projection weights x 384 tokens x 2 = 232 GOP, attention 14.5 GOP more."""
    torch, nn = _torch()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))
            self.ffn1, self.ffn2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
            self.norm1, self.norm2 = nn.LayerNorm(hidden, eps=1e-12), nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (proj(x).view(b, s, heads, hidden // heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hidden // heads)
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, hidden)
            x = self.norm1(x + self.out(context))
            return self.norm2(x + self.ffn2(nn.functional.gelu(self.ffn1(x))))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.words = nn.Embedding(vocab, hidden)
            self.positions = nn.Parameter(torch.zeros(1, seq, hidden))  # position + segment rows of one window
            self.norm = nn.LayerNorm(hidden, eps=1e-12)
            shared = Layer()  # one set of weights run 24 times: the cost is in the shapes (export: 0.2 GB, not 7)
            self.layers = nn.Sequential(*([shared] * layers))
            self.span = nn.Linear(hidden, 2)

        def forward(self, ids):
            return self.span(self.layers(self.norm(self.words(ids.long()) + self.positions)))

    return Bert()


BEVDET_POINTS, BEVDET_CELLS, BEVDET_GRID = 356_761, 13_360, (128, 128)
"""BEVDet-TensorRT's BEV pool on its timed sample: frustum points that land in the grid and the cells they occupy,
recounted with its `InitViewTransformer` (src/bevdet.cpp, commit 023c677; C++ `(int)` truncates toward zero, so
points up to one voxel below the grid's lower bounds count too) from cfgs/bevdet_lt_depth.yaml (6 cameras, 256 x 704
input, stride 16, depth 1-60 m in 0.5 m bins, x/y +-51.2 m at 0.8 m, one z bin from -5 to 3 m) and the calibration
of sample0/sample0000.yaml: 356,761 of 498,432 frustum points, 13,360 of 128 x 128 cells (26.7 points per cell)."""


def _bevdet_bev_pool(shape: tuple, points: int = BEVDET_POINTS, cells: int = BEVDET_CELLS) -> onnx.ModelProto:
    """BEVPoolv2 (`bev_pool_v2_kernel`, src/bevpool.cu) as one fused gather: for each occupied cell, the sum over its
    points of depth[ranks_depth] x feat[ranks_feat] (a row of `channels`), written once into the BEV.

    `shape` = (cameras, depth bins, height, width, channels); inputs `depth` (cameras, bins, height, width) and `feat`
    (cameras, height, width, channels), the image stage's two outputs, FP32. ONNX: Gather depth values and feature rows,
    Mul, ScatterND(reduction="add") into the 128 x 128 grid: `roofline._pools` costs the chain as the one kernel it is
    (TensorRT 8.5 would not import the scatter-add; the graph describes the plugin's cost). The BEV is (1, 128, 128,
    channels) where the kernel writes channels first: the same bytes. Indices are a fixed random draw of the recounted
    sizes (`BEVDET_POINTS`, `BEVDET_CELLS`): the counts are what costs, int32 as in the kernel (scatter indices int64,
    as ONNX requires)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    cameras, bins, height, width, channels = shape
    grid = BEVDET_GRID[0] * BEVDET_GRID[1]
    rng = np.random.default_rng(0)
    occupied = rng.choice(grid, cells, replace=False)
    tensors = {"ranks_depth": rng.integers(0, cameras * bins * height * width, points).astype(np.int32),
               "ranks_feat": rng.integers(0, cameras * height * width, points).astype(np.int32),
               "ranks_bev": np.sort(occupied[rng.integers(0, cells, points)])[:, None].astype(np.int64),
               "flat": np.array([-1], np.int64), "rows": np.array([-1, channels], np.int64),
               "axis": np.array([1], np.int64), "grid": np.array([grid, channels], np.int64),
               "bev_shape": np.array([1, *BEVDET_GRID, channels], np.int64)}
    zero = numpy_helper.from_array(np.zeros(1, np.float32))
    nodes = [helper.make_node(op, inputs, [output], name=output, **attributes) for op, inputs, output, attributes in (
        ("Reshape", ["depth", "flat"], "depth_flat", {}), ("Reshape", ["feat", "rows"], "feat_rows", {}),
        ("Gather", ["depth_flat", "ranks_depth"], "point_depth", {"axis": 0}),
        ("Gather", ["feat_rows", "ranks_feat"], "point_feat", {"axis": 0}),
        ("Unsqueeze", ["point_depth", "axis"], "point_weight", {}),
        ("Mul", ["point_feat", "point_weight"], "weighted", {}),
        ("ConstantOfShape", ["grid"], "empty", {"value": zero}),
        ("ScatterND", ["empty", "ranks_bev", "weighted"], "bev_pool", {"reduction": "add"}),
        ("Reshape", ["bev_pool", "bev_shape"], "bev", {}))]
    inputs = [helper.make_tensor_value_info("depth", TensorProto.FLOAT, [cameras, bins, height, width]),
              helper.make_tensor_value_info("feat", TensorProto.FLOAT, [cameras, height, width, channels])]
    output = helper.make_tensor_value_info("bev", TensorProto.FLOAT, [1, *BEVDET_GRID, channels])
    graph = helper.make_graph(nodes, "bevdet_bev_pool", inputs, [output],
                              [numpy_helper.from_array(value, name) for name, value in tensors.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


GRAPHS = {"bevdet_bev_pool": _bevdet_bev_pool}
"""Reference graphs written directly in ONNX, by builder name (the rest are PyTorch modules, exported)."""


# --- YOLO11 (Ultralytics), reproduced from yolo11.yaml and ultralytics/nn/modules ---------------------------

def _torch():
    import torch
    from torch import nn
    return torch, nn


def _conv(c1, c2, k=1, s=1, g=1, act=True):
    """Ultralytics `Conv`: Conv2d (no bias, 'same' padding) + BatchNorm + SiLU."""
    _, nn = _torch()
    return nn.Sequential(nn.Conv2d(c1, c2, k, s, k // 2, groups=g, bias=False), nn.BatchNorm2d(c2, eps=1e-3),
                         nn.SiLU() if act else nn.Identity())


def _module(name, init, forward):
    _, nn = _torch()
    return type(name, (nn.Module,), {"__init__": init, "forward": forward})


def _bottleneck_init(self, c1, c2, shortcut=True, e=0.5):
    _, nn = _torch()
    nn.Module.__init__(self)
    hidden = int(c2 * e)
    self.cv1, self.cv2, self.add = _conv(c1, hidden, 3), _conv(hidden, c2, 3), shortcut and c1 == c2


def _bottleneck_forward(self, x):
    return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


def _c3k_init(self, c1, c2, n=1, shortcut=True, e=0.5):
    _, nn = _torch()
    nn.Module.__init__(self)
    hidden = int(c2 * e)
    self.cv1, self.cv2, self.cv3 = _conv(c1, hidden), _conv(c1, hidden), _conv(2 * hidden, c2)
    self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, e=1.0) for _ in range(n)))


def _c3k_forward(self, x):
    torch, _ = _torch()
    return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


def _c3k2_init(self, c1, c2, n=1, c3k=False, e=0.5, shortcut=True):
    _, nn = _torch()
    nn.Module.__init__(self)
    self.c = int(c2 * e)
    self.cv1, self.cv2 = _conv(c1, 2 * self.c), _conv((2 + n) * self.c, c2)
    self.m = nn.ModuleList(C3k(self.c, self.c, 2, shortcut) if c3k else Bottleneck(self.c, self.c, shortcut)
                           for _ in range(n))


def _c3k2_forward(self, x):
    torch, _ = _torch()
    y = list(self.cv1(x).chunk(2, 1))
    y.extend(m(y[-1]) for m in self.m)
    return self.cv2(torch.cat(y, 1))


def _sppf_init(self, c1, c2, k=5):
    _, nn = _torch()
    nn.Module.__init__(self)
    hidden = c1 // 2
    self.cv1, self.cv2 = _conv(c1, hidden), _conv(hidden * 4, c2)
    self.m = nn.MaxPool2d(k, 1, k // 2)


def _sppf_forward(self, x):
    torch, _ = _torch()
    y = [self.cv1(x)]
    y.extend(self.m(y[-1]) for _ in range(3))
    return self.cv2(torch.cat(y, 1))


def _attention_init(self, dim, num_heads, attn_ratio=0.5):
    _, nn = _torch()
    nn.Module.__init__(self)
    self.num_heads, self.head_dim = num_heads, dim // num_heads
    self.key_dim = int(self.head_dim * attn_ratio)
    self.scale = self.key_dim ** -0.5
    self.qkv = _conv(dim, dim + 2 * self.key_dim * num_heads, act=False)
    self.proj, self.pe = _conv(dim, dim, act=False), _conv(dim, dim, 3, g=dim, act=False)


def _attention_forward(self, x):
    b, c, h, w = x.shape
    q, k, v = self.qkv(x).view(b, self.num_heads, self.key_dim * 2 + self.head_dim, h * w).split(
        [self.key_dim, self.key_dim, self.head_dim], dim=2)
    attn = ((q.transpose(-2, -1) @ k) * self.scale).softmax(dim=-1)
    x = (v @ attn.transpose(-2, -1)).view(b, c, h, w) + self.pe(v.reshape(b, c, h, w))
    return self.proj(x)


def _psa_init(self, c):
    _, nn = _torch()
    nn.Module.__init__(self)
    self.attn = Attention(c, num_heads=c // 64)
    self.ffn = nn.Sequential(_conv(c, 2 * c), _conv(2 * c, c, act=False))


def _psa_forward(self, x):
    x = x + self.attn(x)
    return x + self.ffn(x)


def _c2psa_init(self, c1, n=1):
    _, nn = _torch()
    nn.Module.__init__(self)
    self.c = int(c1 * 0.5)
    self.cv1, self.cv2 = _conv(c1, 2 * self.c), _conv(2 * self.c, c1)
    self.m = nn.Sequential(*(PSABlock(self.c) for _ in range(n)))


def _c2psa_forward(self, x):
    torch, _ = _torch()
    a, b = self.cv1(x).split((self.c, self.c), dim=1)
    return self.cv2(torch.cat((a, self.m(b)), 1))


Bottleneck = _module("Bottleneck", _bottleneck_init, _bottleneck_forward)
C3k = _module("C3k", _c3k_init, _c3k_forward)
C3k2 = _module("C3k2", _c3k2_init, _c3k2_forward)
SPPF = _module("SPPF", _sppf_init, _sppf_forward)
Attention = _module("Attention", _attention_init, _attention_forward)
PSABlock = _module("PSABlock", _psa_init, _psa_forward)
C2PSA = _module("C2PSA", _c2psa_init, _c2psa_forward)


def _detect_init(self, ch, nc=80, reg_max=16, imgsz=640):
    torch, nn = _torch()
    nn.Module.__init__(self)
    c2, c3 = max(16, ch[0] // 4, reg_max * 4), max(ch[0], min(nc, 100))
    self.nc, self.reg_max = nc, reg_max
    self.cv2 = nn.ModuleList(nn.Sequential(_conv(x, c2, 3), _conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1))
                             for x in ch)
    self.cv3 = nn.ModuleList(nn.Sequential(nn.Sequential(_conv(x, x, 3, g=x), _conv(x, c3)),
                                           nn.Sequential(_conv(c3, c3, 3, g=c3), _conv(c3, c3)), nn.Conv2d(c3, nc, 1))
                             for x in ch)
    self.dfl = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
    self.dfl.weight.data[:] = torch.arange(reg_max, dtype=torch.float).view(1, reg_max, 1, 1)
    anchors, strides = [], []
    for stride in (8, 16, 32):  # anchor points at cell centres, as Ultralytics' make_anchors
        side = imgsz // stride
        ys, xs = torch.meshgrid(torch.arange(side) + 0.5, torch.arange(side) + 0.5, indexing="ij")
        anchors.append(torch.stack((xs, ys), -1).view(-1, 2))
        strides.append(torch.full((side * side, 1), float(stride)))
    self.register_buffer("anchors", torch.cat(anchors).T.unsqueeze(0), persistent=False)
    self.register_buffer("strides", torch.cat(strides).T.unsqueeze(0), persistent=False)


def _detect_forward(self, xs):
    """Boxes decoded in the graph (DFL softmax-expectation, dist2bbox) and class sigmoids: (1, 84, 8400)."""
    torch, _ = _torch()
    out = torch.cat([torch.cat((self.cv2[i](x), self.cv3[i](x)), 1).flatten(2) for i, x in enumerate(xs)], 2)
    box, cls = out.split((4 * self.reg_max, self.nc), 1)
    b, _, a = box.shape
    dist = self.dfl(box.view(b, 4, self.reg_max, a).transpose(2, 1).softmax(1)).view(b, 4, a)
    lt, rb = dist.chunk(2, 1)
    x1y1, x2y2 = self.anchors - lt, self.anchors + rb
    boxes = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * self.strides
    return torch.cat((boxes, cls.sigmoid()), 1)


Detect = _module("Detect", _detect_init, _detect_forward)


def _yolo_init(self, scale: str):
    _, nn = _torch()
    nn.Module.__init__(self)
    depth, width, max_channels = YOLO11_SCALES[scale]

    def ch(c):  # make_divisible(min(c, max) * width, 8)
        return int(math.ceil(min(c, max_channels) * width / 8) * 8)

    def reps(n):
        return max(round(n * depth), 1) if n > 1 else n

    c3k = scale in "mlx"  # Ultralytics forces C3k blocks in C3k2 for the M/L/X sizes
    self.backbone = nn.ModuleList([
        _conv(3, ch(64), 3, 2), _conv(ch(64), ch(128), 3, 2), C3k2(ch(128), ch(256), reps(2), c3k, 0.25),
        _conv(ch(256), ch(256), 3, 2), C3k2(ch(256), ch(512), reps(2), c3k, 0.25),
        _conv(ch(512), ch(512), 3, 2), C3k2(ch(512), ch(512), reps(2), True),
        _conv(ch(512), ch(1024), 3, 2), C3k2(ch(1024), ch(1024), reps(2), True),
        SPPF(ch(1024), ch(1024)), C2PSA(ch(1024), reps(2))])
    self.up = nn.Upsample(scale_factor=2, mode="nearest")
    self.h13 = C3k2(ch(1024) + ch(512), ch(512), reps(2), c3k)
    self.h16 = C3k2(ch(512) + ch(512), ch(256), reps(2), c3k)
    self.down17, self.h19 = _conv(ch(256), ch(256), 3, 2), C3k2(ch(256) + ch(512), ch(512), reps(2), c3k)
    self.down20, self.h22 = _conv(ch(512), ch(512), 3, 2), C3k2(ch(512) + ch(1024), ch(1024), reps(2), True)
    self.detect = Detect((ch(256), ch(512), ch(1024)))


def _yolo_forward(self, x):
    torch, _ = _torch()
    saved = {}
    for i, layer in enumerate(self.backbone):
        x = layer(x)
        saved[i] = x
    p13 = self.h13(torch.cat((self.up(x), saved[6]), 1))
    p16 = self.h16(torch.cat((self.up(p13), saved[4]), 1))
    p19 = self.h19(torch.cat((self.down17(p16), p13), 1))
    p22 = self.h22(torch.cat((self.down20(p19), saved[10]), 1))
    return self.detect([p16, p19, p22])


Yolo11 = _module("Yolo11", _yolo_init, _yolo_forward)
