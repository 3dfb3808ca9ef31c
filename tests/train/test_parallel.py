"""Sharding/checkpointing policies: which modules a pattern picks, and that recomputation changes nothing."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import TinyMultiTask, synthetic_batch, tiny_pipeline  # noqa: E402

from stack.errors import ConfigError
from stack.train.module import warmup_cosine
from stack.train.parallel import apply_activation_checkpointing, build_strategy, fsdp_policies, match_modules, replicas


@pytest.fixture(scope="module")
def pipeline():
    return tiny_pipeline()


def test_patterns_match_level_by_level(pipeline):
    model = TinyMultiTask(pipeline)
    assert [n for n, _ in match_modules(model, ["backbone"], "k")] == ["backbone"]
    assert [n for n, _ in match_modules(model, ["backbone.*"], "k")] == ["backbone.0", "backbone.1"]
    assert [n for n, _ in match_modules(model, ["backbone.*.*"], "k")] == [
        "backbone.0.0", "backbone.0.1", "backbone.1.0", "backbone.1.1"]
    top = [n for n, _ in match_modules(model, ["*"], "k")]
    assert top == ["backbone", "depth_head", "planning_head", "segmentation_head"]


def test_unmatched_pattern_names_the_key_and_existing_modules(pipeline):
    with pytest.raises(ConfigError, match=r"train.fsdp_units: pattern 'backbon\.\*'.*backbone\.0"):
        match_modules(TinyMultiTask(pipeline), ["backbon.*"], "train.fsdp_units")


def test_activation_checkpointing_keeps_keys_outputs_and_gradients(pipeline):
    torch.manual_seed(0)
    plain = TinyMultiTask(pipeline).train()
    recomputed = TinyMultiTask(pipeline).train()
    recomputed.load_state_dict(plain.state_dict())
    wrapped = apply_activation_checkpointing(recomputed, ["backbone.*", "backbone.0.0"])
    assert wrapped == ["backbone.0", "backbone.1"]  # nested matches are wrapped once, outermost
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    batch = synthetic_batch(pipeline, seed=3)
    for model in (plain, recomputed):
        model.loss(model(batch), batch)["total"].backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_strategy_choice(pipeline):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    assert isinstance(build_strategy(tiny_pipeline("train.strategy=fsdp").train), ModelParallelStrategy)
    assert isinstance(build_strategy(tiny_pipeline("train.strategy=ddp").train), DDPStrategy)
    assert build_strategy(pipeline.train) == "auto"


def test_fsdp_policies_gather_bf16_and_reduce_fp32_only_under_bf16_mixed():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    bf16 = fsdp_policies(tiny_pipeline("train.strategy=fsdp", "train.precision=bf16-mixed").train)
    assert (bf16.units.param_dtype, bf16.units.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert bf16.norms == MixedPrecisionPolicy()  # norms, their buffers and gradients stay fp32
    assert fsdp_policies(tiny_pipeline("train.strategy=fsdp").train).units == MixedPrecisionPolicy()
    offload = fsdp_policies(tiny_pipeline("train.strategy=fsdp", "train.accelerator=gpu",
                                          "train.fsdp_cpu_offload=true").train).offload
    assert isinstance(offload, CPUOffloadPolicy) and offload.pin_memory


def test_cpu_offload_strategy_moves_only_buffers_to_the_gpu(pipeline):
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = build_strategy(tiny_pipeline("train.strategy=fsdp", "train.accelerator=gpu",
                                            "train.fsdp_cpu_offload=true").train)
    assert isinstance(strategy, ModelParallelStrategy)
    strategy.parallel_devices = [torch.device("meta")]  # stands in for cuda:0 (no GPU here)
    strategy.model = TinyMultiTask(pipeline)
    strategy.model_to_device()
    assert {p.device.type for p in strategy.model.parameters()} == {"cpu"}  # FSDP2 moves the offloaded shards
    assert {b.device.type for b in strategy.model.buffers()} == {"meta"}  # BatchNorm statistics on the device


def test_cpu_offload_is_refused_without_gpus():
    for overrides in (["train.strategy=fsdp"], ["train.strategy=ddp", "train.accelerator=gpu"]):
        with pytest.raises(ConfigError, match="train.fsdp_cpu_offload=true needs train.strategy=fsdp on GPUs"):
            build_strategy(tiny_pipeline("train.fsdp_cpu_offload=true", *overrides).train)


def test_hsdp_replicas_default_to_one_per_node_and_must_divide_the_ranks():
    assert replicas(tiny_pipeline("train.devices=4", "train.num_nodes=2").train) == 2
    assert replicas(tiny_pipeline("train.devices=2", "train.fsdp_replicate=2").train) == 2
    for bad in ("3", "0", "two"):
        with pytest.raises(ConfigError, match=f"train.fsdp_replicate: got '{bad}'; use auto .* divisor of the 2 ranks"):
            tiny_pipeline("train.devices=2", f"train.fsdp_replicate={bad}")


def test_warmup_then_cosine_decay():
    factor = warmup_cosine(4, 20)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == pytest.approx(1.0)
    assert factor(12) == pytest.approx(0.05 + 0.95 * 0.5)
    assert factor(20) == pytest.approx(0.05) and factor(40) == pytest.approx(0.05)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (FSDP2 needs one to shard over)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_real_network_trains_with_bf16_gathers_and_its_fp32_layers_kept(one_rank_group):
    """The planner runs its waypoint layer with autocast off: FSDP2 must gather it in fp32 (a bf16
    weight meets an fp32 input there: 'mat1 and mat2 must have the same dtype')."""
    from stack.config import load_pipeline
    from stack.models import build_model
    from stack.synthetic_batch import random_batch
    from stack.train.parallel import apply_fsdp

    pipeline = load_pipeline(["configs/pipeline.yaml", "configs/presets/tiny.yaml"],
                             ["train.strategy=fsdp", "train.precision=bf16-mixed", "data.batch_size=1"])
    torch.manual_seed(0)
    model = build_model(pipeline).train()
    apply_fsdp(model, pipeline.train, "cpu")
    seen = {}
    for name in ("planning_head.waypoints", "planning_head.ego.0"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, name=name: seen.setdefault(name, module.weight.dtype) and None)
    batch = random_batch(pipeline, 1, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(model.forward_batch(batch), batch)["total"]
    loss.backward()
    assert seen == {"planning_head.waypoints": torch.float32, "planning_head.ego.0": torch.bfloat16}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
