"""`stack bench data` renders enough frames for a many-batch loader epoch, whatever the scene length."""

from stack.data.bench import BENCH_FRAMES, bench_scenes


def test_short_scenes_render_more_of_them():
    assert bench_scenes(6) == 16
    assert bench_scenes(24) == 4


def test_a_scene_length_that_does_not_divide_rounds_up():
    scenes = bench_scenes(7)
    assert scenes * 7 >= BENCH_FRAMES > (scenes - 1) * 7


def test_a_recorded_loader_rate_keeps_every_repeat_and_its_bare_decode_floor():
    """`--record` keeps each interleaved repeat; a loader's floor is the best rate of the decode it is set against."""
    from stack.benchrecord import FigureLog
    from stack.data.bench import record_figures

    log = FigureLog()
    record_figures(log, 61.5, {"torch": [40.0, 42.0, 41.0], "pil": [90.0, 95.0, 80.0], "dali_augment_graph": [30.0],
                               "torch_previous_frame": [25.0]})
    figures = {figure.name: figure for figure in log.figures}
    assert figures["rate: torch_previous_frame"].floor == 47.5, "twice the JPEGs a sample: half the decode rate"
    assert figures["rate: torch"].samples == (40.0, 42.0, 41.0) and figures["rate: torch"].floor == 95.0
    assert not figures["rate: torch"].lower_is_better and figures["rate: pil"].floor is None
    assert figures["generator (make, end to end)"].samples == (61.5,)
