"""`stack bench data`'s renderer rows: both renderers draw the same frames, and the rows say what was compared."""

from stack import bench_only

render_bench = bench_only.load("render_side_by_side")


def test_side_by_side_renders_every_frame_with_both(small_pipeline, tmp_path):
    pipeline = small_pipeline(tmp_path, "data.rig.image_width=64", "data.rig.image_height=32",
                              "data.world.frames_per_scene=2", "data.world.agents_per_scene=6")
    logged = []
    timing = render_bench.side_by_side(pipeline, scenes=1, log=logged.append)
    assert timing.images == 2 * len(pipeline.data.rig.cameras)
    assert min(timing.setup_cpu_s, timing.new_cpu_s, timing.reference_cpu_s) > 0
    assert logged == ["renderer side by side: scene 1/1"]
    rows = render_bench.rows(timing, cores=2)
    assert "raycast_reference" in rows[0] and rows[0].count("images/CPU-s") == 2
    assert "goal 60" in rows[2]
