"""`stack.models.layers.GroupNorm`: ATen's GroupNorm, computed in the layout its CPU kernel is fast in."""

import pytest
import torch
from torch import nn

from stack.models.layers import GroupNorm, group_norm


def _pair(channels: int = 32, groups: int = 8):
    torch.manual_seed(0)
    ours, reference = GroupNorm(groups, channels), nn.GroupNorm(groups, channels)
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    reference.load_state_dict(ours.state_dict())
    return ours, reference


@pytest.mark.parametrize("channels_last", [True, False])
def test_group_norm_matches_aten_in_value_and_gradient(channels_last):
    ours, reference = _pair()
    x = torch.randn(3, 32, 9, 14) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(3, 32, 9, 14).contiguous(memory_format=torch.channels_last)
    outputs = []
    for module in (ours, reference):
        leaf = x.clone().requires_grad_(True)
        y = module(leaf)
        y.backward(grad)
        outputs.append((y, leaf.grad, module.weight.grad, module.bias.grad))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert outputs[0][0].is_contiguous(memory_format=torch.channels_last) == channels_last


def test_group_norm_keeps_the_module_contract():
    """Same parameters and state-dict keys as nn.GroupNorm (checkpoints load both ways), the same groups rule."""
    ours, reference = _pair()
    assert isinstance(ours, nn.GroupNorm)
    assert list(ours.state_dict()) == list(reference.state_dict())
    assert isinstance(group_norm(48), GroupNorm) and group_norm(48).num_groups == 16


def test_group_norm_in_bf16_autocast_stays_close_to_aten():
    ours, reference = _pair()
    x = torch.randn(2, 32, 8, 8).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = ours(x.bfloat16()), reference(x.bfloat16())
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.05)
