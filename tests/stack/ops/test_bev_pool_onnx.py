"""The export form of BEV pooling: exact against the op, standard ONNX ops only, same result in ONNX Runtime."""

import numpy as np
import pytest
import torch
from bev_cases import make_geometry, random_inputs

from stack.ops import FixedBevPool, bev_pool, bev_pool_onnx_friendly, bev_pool_tables
from stack.ops.bev_pool_onnx import ONNX_OPS
from stack.pipeline import BevGridConfig

ONE_CELL = BevGridConfig(x_range=[-80.0, 80.0], y_range=[-80.0, 80.0], z_range=[-10.0, 40.0], cell_size=160.0)
NOTHING = BevGridConfig(x_range=[1000.0, 1010.0], y_range=[0.0, 10.0], cell_size=1.0)


@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("bev", [None, ONE_CELL, NOTHING], ids=["random", "one_cell", "nothing_in_range"])
def test_tables_reproduce_the_op(chunks, bev):
    geometry, *_ = make_geometry(batch=2, bev=bev)
    depth, context = random_inputs(geometry, channels=6)
    tables = bev_pool_tables(geometry, chunks=chunks)
    assert len(tables.depth_index) <= chunks
    assert sum(int((t < depth.numel()).sum()) for t in tables.depth_index) == geometry.num_points
    torch.testing.assert_close(bev_pool_onnx_friendly(depth, context, tables), bev_pool(depth, context, geometry),
                               atol=1e-5, rtol=1e-5)


def test_chunking_keeps_padding_small():
    geometry, *_ = make_geometry(batch=2, cameras=6, bins=24, bev=BevGridConfig(cell_size=2.0))
    one, eight = bev_pool_tables(geometry, chunks=1), bev_pool_tables(geometry, chunks=8)
    assert one.padded_slots == geometry.num_cells * int(geometry.interval_lengths.max())
    assert eight.padded_slots < 1.5 * geometry.num_points < one.padded_slots


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_export_uses_only_standard_ops_and_matches_in_onnx_runtime(tmp_path, dynamo):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    geometry, *_ = make_geometry(batch=1, cameras=4, bins=12)
    depth, context = random_inputs(geometry, channels=8)
    module = FixedBevPool(geometry, chunks=4).eval()
    path = tmp_path / "bev_pool.onnx"
    torch.onnx.export(module, (depth, context), str(path), input_names=["depth", "context"], output_names=["bev"],
                      opset_version=17, dynamo=dynamo)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    ops = {node.op_type for node in model.graph.node}
    assert ops <= ONNX_OPS, f"unexpected ONNX ops: {sorted(ops - ONNX_OPS)}"
    assert {"Gather", "MatMul"} <= ops and not ops & {"ScatterND", "ScatterElements", "CumSum"}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"depth": depth.numpy(), "context": context.numpy()})
    np.testing.assert_allclose(out, bev_pool(depth, context, geometry).numpy(), atol=1e-5, rtol=1e-5)
