"""`stack bench data` renders enough frames for a many-batch loader epoch, whatever the scene length."""

from stack.data.bench import BENCH_FRAMES, bench_scenes


def test_short_scenes_render_more_of_them():
    assert bench_scenes(6) == 16
    assert bench_scenes(24) == 4


def test_a_scene_length_that_does_not_divide_rounds_up():
    scenes = bench_scenes(7)
    assert scenes * 7 >= BENCH_FRAMES > (scenes - 1) * 7
