"""The network's named outputs: the one description of names, shapes, dtypes and units.

`BevNet.forward` returns a dict with exactly these keys; the deploy stage writes
`output_layout(pipeline)` into the ONNX file's metadata so a runtime never guesses
which tensor is which. Symbols: B batch, N cameras, D depth bins, S segmentation
classes, C detection classes, X x Y BEV cells (X along ego x, Y along ego y),
K planning modes, T planning steps, h x w = image size / `model.feature_stride`,
hs x ws = image size / `model.segmentation_stride`.
"""

from __future__ import annotations

from stack.pipeline import Pipeline

OUTPUTS = {
    "depth_logits": ("B,N,D,h,w", "logits over uniform depth bins [depth.min_m, depth.max_m) of z-depth; "
                     "softmax, then the expectation over bin centres is metric depth (decode_depth)"),
    "seg_logits": ("B,N,S,hs,ws", "per-pixel class logits in model.segmentation_classes order (decode_segmentation)"),
    "heatmap": ("B,C,X,Y", "CenterPoint centre-heatmap logits per detection class; sigmoid gives the score"),
    "box_regression": ("B,10,X,Y", "per-cell box fields REGRESSION_FIELDS: dx, dy (offset within the cell, cells), "
                       "z (m), log length/width/height (log m), sin/cos yaw, vx, vy (m/s), ego frame"),
    "plan_trajectories": ("B,K,T,2", "K candidate ego trajectories, xy metres in the current ego frame, "
                          "one waypoint per 0.5 s"),
    "plan_scores": ("B,K", "mode logits (path-speed planner: log p(expert) + log p(no collision)); softmax gives "
                    "each trajectory's probability (decode_plan picks the best)"),
}
"""Output name -> (symbolic shape, meaning and units). All outputs are float32 (float16/bf16 under autocast)."""

ATTRIBUTE_OUTPUT = "attribute_logits"
OPTIONAL_OUTPUTS = {
    ATTRIBUTE_OUTPUT: ("B,A,X,Y", "per-cell logits over nuScenes' box attributes stack.metrics.detection.ATTRIBUTES "
                       "(vehicle moving / parked / stopped, pedestrian moving / standing, cycle with / without rider), "
                       "read at a detection's centre cell; only with model.attribute_head"),
}
"""Outputs a configuration adds (each key's condition in `output_names`)."""


def output_names(model) -> list[str]:
    """The outputs a network of this model configuration returns and its exported graph ends in, in order."""
    return list(OUTPUTS) + ([ATTRIBUTE_OUTPUT] if model.attribute_head else [])

TRAINING_OUTPUTS = {
    "plan_path": ("B,P,2", "the path-speed planner's path: a point every model.path_spacing_m metres, ego frame"),
    "plan_speed_logits": ("B,K", "imitation logits of its speed candidates (softmax: which the expert drives)"),
    "plan_collision_logits": ("B,K", "collision logits of its speed candidates (sigmoid: the candidate hits a box)"),
    "plan_arc_refinement": ("B,K,T", "metres each speed candidate's waypoints move along the path from its anchor"),
    "plan_drivable_logits": ("B,X,Y", "drivable-area logits per BEV cell (sigmoid: the ego may drive there)"),
}
"""Outputs the path-speed planner adds for its loss (`model.planning_accelerations` set); export leaves them out."""


def plan_candidates(model) -> int:
    """K: the trajectories the planner proposes (speed candidates of the path-speed planner, else modes)."""
    return len(model.planning_accelerations) or model.planning_modes


def output_shapes(pipeline: Pipeline, batch: int) -> dict[str, tuple[int, ...]]:
    """The concrete shape of every output for `pipeline` at batch size `batch`."""
    from stack.metrics.detection import ATTRIBUTES
    from stack.ops.bev_pool import grid_cells

    model, rig = pipeline.model, pipeline.data.rig
    n, height, width = len(rig.cameras), rig.image_height, rig.image_width
    fs, ss = model.feature_stride, model.segmentation_stride
    grid_x, grid_y = grid_cells(model.bev)
    return {
        "depth_logits": (batch, n, model.depth.bins, height // fs, width // fs),
        "seg_logits": (batch, n, len(model.segmentation_classes), height // ss, width // ss),
        "heatmap": (batch, len(model.detection_classes), grid_x, grid_y),
        "box_regression": (batch, 10, grid_x, grid_y),
        "plan_trajectories": (batch, plan_candidates(model), model.planning_steps, 2),
        "plan_scores": (batch, plan_candidates(model)),
        **({ATTRIBUTE_OUTPUT: (batch, len(ATTRIBUTES), grid_x, grid_y)} if model.attribute_head else {}),
    }


def output_layout(pipeline: Pipeline, batch: int = 1) -> dict[str, str]:
    """Name -> "shape: meaning" strings for ONNX `metadata_props` (and reports)."""
    shapes = output_shapes(pipeline, batch)
    described = {**OUTPUTS, **OPTIONAL_OUTPUTS}
    return {name: f"{'x'.join(map(str, shapes[name]))} ({described[name][0]}): {described[name][1]}"
            for name in output_names(pipeline.model)}
