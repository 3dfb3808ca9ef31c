"""Sharding/checkpointing policies: which modules a pattern picks, and that recomputation changes nothing."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import TinyMultiTask, synthetic_batch, tiny_pipeline  # noqa: E402

from stack.errors import ConfigError
from stack.train.module import warmup_cosine
from stack.train.parallel import apply_activation_checkpointing, build_strategy, match_modules


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


def test_warmup_then_cosine_decay():
    factor = warmup_cosine(4, 20)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == pytest.approx(1.0)
    assert factor(12) == pytest.approx(0.05 + 0.95 * 0.5)
    assert factor(20) == pytest.approx(0.05) and factor(40) == pytest.approx(0.05)
