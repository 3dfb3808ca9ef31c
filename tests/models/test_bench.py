"""`stack bench model` is registered and attributes every counted FLOP to a named component."""

import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

from stack.commands.bench import BENCHMARKS
from stack.config import load_pipeline
from stack.models import build_model
from stack.models.bench import component_flops
from stack.models.network import COMPONENTS
from stack.synthetic_batch import random_batch


def test_model_benchmark_is_registered():
    assert BENCHMARKS["model"] == "stack.models.bench:run"


def test_component_flops_cover_the_whole_forward():
    warnings.filterwarnings("ignore", message="bev_pool: the extension")
    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"])
    model = build_model(pipeline).eval()
    batch = random_batch(pipeline, batch_size=1)
    geometry = model.geometry(batch.intrinsics, batch.cam_to_ego)
    flops = component_flops(model, batch, geometry)
    assert set(flops) == set(COMPONENTS)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(batch.images, batch.ego_status, batch.command, geometry)
    counted = sum(v for k, v in flops.items() if k != "view_transform")
    assert counted == counter.get_total_flops()  # nothing outside the listed components
    assert flops["view_transform"] == 2 * geometry.num_points * pipeline.model.neck_channels
    assert flops["image_encoder"] > flops["bev_encoder"] > flops["planning_head"] > 0
