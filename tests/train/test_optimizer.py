"""`stack.train.module.build_adamw`: the fused AdamW `stack train` steps with is the same update as foreach."""

import torch

from stack.train.module import build_adamw


def _steps(make, steps: int = 5):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    optimizer = make([{"params": [layer.weight], "weight_decay": 0.01}, {"params": [layer.bias], "weight_decay": 0.0}])
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = layer(torch.randn(4, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return layer, optimizer


def test_fused_adamw_takes_the_foreach_steps():
    fused, optimizer = _steps(lambda groups: build_adamw(groups, lr=1e-2))
    foreach, _ = _steps(lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.999), foreach=True))
    assert optimizer.param_groups[0]["fused"] is True
    for got, want in zip(fused.parameters(), foreach.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_sharded_parameters_get_the_foreach_kernel():
    layer = torch.nn.Linear(4, 4)
    optimizer = build_adamw(layer.parameters(), lr=1e-3, sharded=True)
    assert optimizer.param_groups[0]["foreach"] is True and not optimizer.param_groups[0]["fused"]
