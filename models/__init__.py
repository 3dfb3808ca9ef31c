"""stack.models: the multi-task BEV perception/planning network (plain nn.Modules, export-friendly).

`build_model(pipeline)` returns a `BevNet`; its named outputs are described in
`stack.models.outputs`, decoders live in `stack.models.decoders` and losses in `stack.models.losses`;
`stack.synthetic_batch.random_batch` makes synthetic Batches for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stack.models.network import BevNet
    from stack.pipeline import Pipeline


def build_model(pipeline: "Pipeline") -> "BevNet":
    """The network for `pipeline.model` and `pipeline.data.rig`, freshly initialised."""
    from stack.models.network import BevNet

    return BevNet(pipeline)


__all__ = ["build_model"]
