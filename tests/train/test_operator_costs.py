"""`stack.train.operator_costs`: one step's operators, charged to the parts that ran them, against given ceilings."""

import contextlib

import torch
from torch import nn

from stack.train.operator_costs import PeakRates, roofline_rows, roofline_table, step_roofline


class TwoParts(nn.Module):
    """The `stack.models` contract in miniature: two top-level parts and a loss."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.head = nn.Linear(8, 2)

    def forward(self, images):
        features = self.encoder(images).relu().mean(dim=(2, 3))
        return {"logits": self.head(features)}

    def loss(self, outputs, images):
        return {"total": outputs["logits"].square().mean()}


RATES = PeakRates({torch.float32: 0.1}, bandwidth_gbs=10.0)


def _rows():
    torch.manual_seed(0)
    model = TwoParts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    images = torch.randn(2, 3, 16, 16)
    return model, roofline_rows(step_roofline(model, images, optimizer, RATES, contextlib.nullcontext,
                                              torch.device("cpu")))


def test_each_part_is_charged_its_own_flops_and_bytes():
    _, rows = _rows()
    by_part = {(row["part"], row["phase"]): row for row in rows}
    assert {("encoder", "forward"), ("head", "forward"), ("loss", "forward"), ("network and loss", "backward"),
            ("optimizer", "step"), ("step", "all")} <= set(by_part)
    conv_flops = 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)  # 2 x outputs x (in channels x kernel)
    assert abs(by_part["encoder", "forward"]["gflop"] * 1e9 - conv_flops) < 1
    assert abs(by_part["head", "forward"]["gflop"] * 1e9 - 2 * 2 * 8 * 2) < 1  # the Linear: 2 x B x in x out
    # The convolution must read its input and weight and write its output at least.
    assert by_part["encoder", "forward"]["mb"] * 2**20 >= 4 * (2 * 3 * 16 * 16 + 8 * 3 * 9 + 2 * 8 * 16 * 16)


def test_floors_follow_the_ceilings_and_the_total_adds_up():
    _, rows = _rows()
    total = rows[-1]
    for row in rows[:-1]:
        assert row["floor_ms"] >= max(row["compute_floor_ms"], row["memory_floor_ms"]) - 1e-9
        assert row["floor_ms"] <= row["compute_floor_ms"] + row["memory_floor_ms"] + 1e-9
    assert abs(total["gflop"] - sum(row["gflop"] for row in rows[:-1])) < 1e-12
    assert abs(total["compute_floor_ms"] - total["gflop"] / 0.1) < 1e-6  # 0.1 TFLOP/s: GFLOP / 0.1 = ms
    assert total["ms"] > 0 and total["operators"] == sum(row["operators"] for row in rows[:-1])


def test_the_step_it_times_is_a_real_training_step():
    model, _ = _rows()
    reference = TwoParts()
    assert not torch.equal(model.head.weight, reference.head.weight)  # the optimizer stepped
    assert all(p.grad is None for p in model.parameters())  # and zeroed the gradients, as training does


def test_the_table_names_its_ceilings():
    _, rows = _rows()
    table = roofline_table(rows, RATES)
    assert "| encoder | forward |" in table and "copy bandwidth 10.0 GB/s" in table and "float32 0.1 TFLOP/s" in table
