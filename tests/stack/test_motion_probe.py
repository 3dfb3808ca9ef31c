"""benchmarks/motion_probe.py: its error split and its probe, on features whose motion content is known."""

import numpy as np
import pytest

from stack import bench_only

probe = bench_only.load("motion_probe")
pytestmark = pytest.mark.skipif(probe is None, reason=bench_only.MISSING)


def test_the_error_splits_along_and_across_the_ray_from_the_ego():
    position = np.array([[10.0, 0.0], [0.0, -5.0]], np.float32)
    velocity = np.zeros((2, 2), np.float32)
    predicted = np.array([[3.0, 4.0], [1.0, 0.0]], np.float32)
    total, along, across = probe.errors(predicted, velocity, position)
    assert total == pytest.approx((5.0 + 1.0) / 2)
    assert along == pytest.approx((3.0 + 0.0) / 2) and across == pytest.approx((4.0 + 1.0) / 2)


def test_the_probe_reads_a_velocity_only_the_second_patch_holds():
    """Velocity written into the 'previous' features only: the probe on both inputs finds it, on one it cannot."""
    rng = np.random.default_rng(0)
    velocity = rng.normal(0, 3, (1200, 2)).astype(np.float32)
    current = rng.normal(0, 1, (1200, 16)).astype(np.float32)
    previous = np.hstack([velocity @ rng.normal(0, 1, (2, 8)), rng.normal(0, 1, (1200, 8))]).astype(np.float32)
    both = np.hstack([current, previous])
    position = rng.normal(0, 10, (200, 2)).astype(np.float32)
    blind = probe.mlp_probe(current[:1000], velocity[:1000], current[1000:], seed=0, epochs=15)
    seeing = probe.mlp_probe(both[:1000], velocity[:1000], both[1000:], seed=0, epochs=15)
    blind_error, seeing_error = (probe.errors(p, velocity[1000:], position)[0] for p in (blind, seeing))
    assert seeing_error < 0.5 * blind_error, (seeing_error, blind_error)
