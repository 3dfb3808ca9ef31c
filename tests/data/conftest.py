"""A small rendered dataset shared by the data tests (2 scenes x 3 frames, 6 cameras at 128x64)."""

import pytest

from stack.config import load_pipeline

SMALL = ["data.rig.image_width=128", "data.rig.image_height=64", "data.world.scenes=3",
         "data.world.frames_per_scene=3", "data.world.agents_per_scene=10", "data.samples_per_shard=2",
         "data.world.val_fraction=0.34", "data.world.render_device=cpu", "data.batch_size=2", "data.num_workers=0",
         "model.max_boxes=16"]


def small_pipeline(root, *extra):
    return load_pipeline(overrides=[*SMALL, f"data.root={root}", *extra])


@pytest.fixture(name="small_pipeline", scope="session")
def small_pipeline_fixture():
    """small_pipeline(root, *overrides) -> Pipeline."""
    return small_pipeline


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """(pipeline, manifest) of a freshly rendered small dataset."""
    from stack.data.make import make_dataset

    root = tmp_path_factory.mktemp("world")
    pipeline = small_pipeline(root)
    return pipeline, make_dataset(pipeline, log=lambda *_: None)


@pytest.fixture(scope="session")
def clips(tmp_path_factory):
    """(pipeline, manifest) of the same small world rendered as clip shards (data.layout=clips)."""
    from stack.data.make import make_dataset

    root = tmp_path_factory.mktemp("clips")
    pipeline = small_pipeline(root, "data.layout=clips")
    return pipeline, make_dataset(pipeline, log=lambda *_: None)
