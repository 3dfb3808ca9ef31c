"""Augmentation inside the DALI graph: the pixels in DALI, the parameters and the label geometry in Python.

Each sample's parameters are drawn in Python by `stack.data.augment.draw_params` from
the loader's seeded stream, the same function and order the torch backend uses, and
enter the graph through external sources (`INPUTS`). The graph then does the per-pixel
work on DALI's threads instead of per row in Python:

- images: `fn.resize` (bilinear, antialiased when shrinking, like torch's
  `F.interpolate(..., antialias=True)`), `fn.slice` with `out_of_bounds_policy="pad"`
  (crop, or pad with 0 where the resized image is smaller), and colour jitter as one
  affine map per pixel (`fn.coord_transform`, `augment.colour_transform`), whose shift
  needs the image mean (`fn.reductions.mean`);
- depth and semantics: `fn.resize` nearest (DALI's pixel-centre rule, which
  `augment.nearest_indices` reproduces bit for bit on the torch side), padded with
  depth 0 / IGNORE_INDEX. Depth is float16 and DALI resizes no float16, so it is
  resized as its uint16 bit pattern (`fn.reinterpret`): nearest only copies values.

The loader feeds each batch's parameters with its encoded members (the graph runs one
batch at a time, fed before each run) and applies the label geometry in Python
(`augment.apply_geometry`: the intrinsics of the resize/crop, the BEV rotation of
boxes, camera poses and trajectories) from the same `AugmentParams`.
"""

from __future__ import annotations

import numpy as np

from stack.batch import IGNORE_INDEX
from stack.data.augment import apply_geometry, colour_transform, draw_params
from stack.pipeline import AugmentConfig

NO_COLOUR = (1.0, 1.0, 1.0)
INPUTS = ("augment.size", "augment.anchor", "augment.matrix", "augment.shift")
"""The graph's external sources for the parameters: resized (h, w), crop anchor (y, x), colour matrix, colour shift."""


class GraphAugment:
    """Draws each sample's parameters in Python, feeds them to the graph, and builds the graph ops."""

    def __init__(self, config: AugmentConfig, height: int, width: int):
        self.config, self.height, self.width = config, height, width
        self.resizes = tuple(config.resize_scale) != (1.0, 1.0)
        self.jitters = config.color_jitter > 0
        self.used = ()

    def draw(self, rng: np.random.Generator, count: int) -> list:
        """`count` samples' AugmentParams, drawn as the torch backend draws them for `count` rows."""
        return [draw_params(self.config, self.height, self.width, rng) for _ in range(count)]

    def feed(self, pipe, params: list) -> None:
        """Give the graph one batch's parameters (with `stack.data.dali_loader.feed`, before `pipe.run()`)."""
        colours = [colour_transform(*(p.colour or NO_COLOUR)) for p in params]
        values = ([np.array([p.new_h, p.new_w], np.float32) for p in params],
                  [np.array([p.crop_y, p.crop_x], np.int32) for p in params],
                  [matrix for matrix, _ in colours],
                  [np.array(shift, np.float32) for _, shift in colours])
        for name, batch in zip(INPUTS, values):
            if name in self.used:  # DALI prunes the sources of augmentations that are off
                pipe.feed_input(name, batch)

    def apply(self, fn, types, images: list, depth, semantic):
        """Graph ops for HWC uint8 `images` (one node per camera), (camera, H, W) `depth` (float16) and
        `semantic` (uint8, already class-mapped); returns the augmented (images, depth, semantic)."""
        size, anchor, matrix, shift = (fn.external_source(name=name, batch=True) for name in INPUTS)
        self.used = (INPUTS[:2] if self.resizes else ()) + (INPUTS[2:] if self.jitters else ())
        if self.resizes:
            images = [self._place(fn, fn.resize(image, size=size, interp_type=types.INTERP_LINEAR, antialias=True),
                                  anchor, 0) for image in images]
            depth = fn.reinterpret(depth, dtype=types.UINT16, layout="CHW")
            depth = fn.reinterpret(self._nearest(fn, types, depth, size, anchor, 0), dtype=types.FLOAT16)
            semantic = self._nearest(fn, types, fn.reinterpret(semantic, layout="CHW"), size, anchor, IGNORE_INDEX)
        if self.jitters:
            images = [self._jitter(fn, types, image, matrix, shift) for image in images]
        return images, depth, semantic

    def _place(self, fn, resized, anchor, fill):
        """Crop (anchor >= 0) or pad (anchor < 0, filled with `fill`) back to the rig's size."""
        return fn.slice(resized, anchor, [self.height, self.width], axis_names="HW", out_of_bounds_policy="pad",
                        fill_values=fill)

    def _nearest(self, fn, types, dense, size, anchor, fill):
        resized = fn.resize(dense, size=size, interp_type=types.INTERP_NN, antialias=False)
        return self._place(fn, resized, anchor, fill)

    @staticmethod
    def _jitter(fn, types, image, matrix, shift):
        mean = fn.reductions.mean(image, dtype=types.FLOAT)
        if getattr(mean, "device", "cpu") == "gpu":  # argument inputs live on the CPU
            mean = mean.cpu()
        return fn.coord_transform(image, M=matrix, T=shift * mean, dtype=types.UINT8)

    @staticmethod
    def geometry(labels: list, params: list) -> list:
        """Apply each sample's parameters to its label row (intrinsics, BEV rotation), in place."""
        for row, sample_params in zip(labels, params):
            apply_geometry(row, sample_params)
        return labels
