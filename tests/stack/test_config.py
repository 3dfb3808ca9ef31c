"""The pipeline definition: every shipped YAML loads, overrides apply, YAML round-trips."""

import dataclasses
import typing

import pytest

from stack import pipeline as schema
from stack.config import (
    CONFIG_DIR, _field_docs, describe, load_pipeline, load_target, pipeline_from_yaml,
    pipeline_hash, pipeline_to_yaml,
)
from stack.errors import ConfigError

DEFAULT = CONFIG_DIR / "pipeline.yaml"
PRESETS = sorted((CONFIG_DIR / "presets").glob("*.yaml"))
TARGETS = sorted((CONFIG_DIR / "targets").glob("*.yaml"))
REQUIRED_TARGETS = {"orin", "orin-nano", "x86-gpu", "cpu", "ci-cpu"}


def test_default_pipeline_loads_as_typed_object():
    pipeline = load_pipeline([DEFAULT])
    assert isinstance(pipeline, schema.Pipeline)
    assert isinstance(pipeline.data.rig.cameras[0], schema.Camera)
    assert isinstance(pipeline.targets["orin"], schema.Target)
    assert len(pipeline.data.rig.cameras) == 6


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_over_the_default(preset):
    pipeline = load_pipeline([DEFAULT, preset])
    assert pipeline.name == preset.stem


def test_presets_exist():
    assert {p.stem for p in PRESETS} >= {"tiny"}


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.stem)
def test_every_target_validates_and_names_its_sources(target):
    loaded = load_target(target.stem, load_pipeline([DEFAULT]))
    assert loaded.description
    assert loaded.peaks_source, "every target says where its peak figures come from"
    if loaded.runtime == "tensorrt":
        assert loaded.qdq_flavour == "tensorrt" and not loaded.measured
        assert loaded.int8_tops > 0 and loaded.fp16_tflops > 0 and loaded.memory_bandwidth_gbs > 0


def test_required_targets_are_shipped():
    assert REQUIRED_TARGETS <= {p.stem for p in TARGETS}


def test_overrides_apply_after_files():
    pipeline = load_pipeline([DEFAULT], ["train.max_epochs=3", "data.rig.cameras.1.hfov_deg=90",
                                         "targets.orin.min_fps=30", "train.activation_checkpointing=[backbone]"])
    assert pipeline.train.max_epochs == 3
    assert pipeline.data.rig.cameras[1].hfov_deg == 90.0
    assert pipeline.targets["orin"].min_fps == 30.0
    assert pipeline.train.activation_checkpointing == ["backbone"]


def test_later_files_win(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("train: {max_epochs: 2, lr: 0.5}\n")
    second.write_text("train: {max_epochs: 7}\n")
    pipeline = load_pipeline([first, second])
    assert (pipeline.train.max_epochs, pipeline.train.lr) == (7, 0.5)


def test_a_config_file_can_define_a_new_target(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("targets:\n  thor:\n    runtime: tensorrt\n    qdq_flavour: tensorrt\n    min_fps: 30\n")
    assert load_pipeline([path]).targets["thor"].min_fps == 30.0


def test_yaml_round_trip_rebuilds_the_same_pipeline():
    pipeline = load_pipeline([DEFAULT, CONFIG_DIR / "presets" / "tiny.yaml"], ["model.planning_modes=3"])
    rebuilt = pipeline_from_yaml(pipeline_to_yaml(pipeline), "test")
    assert rebuilt == pipeline
    assert pipeline_hash(rebuilt) == pipeline_hash(pipeline)


def test_hash_changes_with_any_value():
    base = load_pipeline([DEFAULT])
    assert pipeline_hash(base) != pipeline_hash(load_pipeline([DEFAULT], ["data.world.seed=1"]))


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_pipeline([DEFAULT], ["train.lr=0", "data.backend=nope", "model.depth.max_m=0.5"])
    text = str(info.value)
    assert "train.lr" in text and "data.backend" in text and "model.depth.max_m" in text
    assert "allowed: torch, dali" in text


TODAY = f"schema_version: {schema.SCHEMA_VERSION}"


def test_an_artifact_of_schema_1_is_read_with_its_guard_moved_and_a_config_file_is_told_where_it_went(tmp_path):
    """Schema 2 moved the plan guard's settings from model.plan_guard_* to the guard section: a checkpoint written
    before still loads with its settings; a user's file naming an old key is told the new one."""
    text = pipeline_to_yaml(load_pipeline([DEFAULT])).replace(TODAY, "schema_version: 1")
    text = text.replace("\nmodel:\n", "\nmodel:\n  plan_guard_score: 0.15\n  plan_guard_reaction_s: 0.6\n"
                                      "  plan_guard_confirm_below: 0.0\n", 1)
    text = text.replace("\nguard:\n  score: 0.0\n", "\nguard:\n", 1)
    read = pipeline_from_yaml(text, "checkpoint x.ckpt")
    assert (read.guard.score, read.guard.reaction_s, read.schema_version) == (0.15, 0.6, schema.SCHEMA_VERSION)
    with pytest.raises(ConfigError, match="plan_guard_confirm_below: 0.3. It was removed in pipeline schema 3"):
        pipeline_from_yaml(text.replace("plan_guard_confirm_below: 0.0", "plan_guard_confirm_below: 0.3"), "x.ckpt")
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  plan_guard_score: 0.2\n")
    with pytest.raises(ConfigError, match="model.plan_guard_score.*moved to 'guard.score'"):
        load_pipeline([DEFAULT, old])


SCHEMA_2 = CONFIG_DIR.parent / "tests" / "assets" / "schema2"
SCHEMA_2_PIPELINE = SCHEMA_2 / "pipeline.yaml"
"""A schema-2 artifact's pipeline (a tiny-drive network pinned under schema 2): it has the keys schema 3 removed,
at 0; post_processing.json beside it is what that artifact's card recorded as shipped."""
REMOVED = {"guard.confirm_below": ("confirm_below: 0.0", "confirm_below: 0.3", "guard-restart-confirmation"),
           "guard.defer_below": ("defer_below: 0.0", "defer_below: 0.3", "room-to-stop"),
           "model.planning_stop_deceleration": ("planning_stop_deceleration: 0.0", "planning_stop_deceleration: 3.5",
                                                "2026-11-27_plan-guard")}
"""Each key schema 3 removed: its line at 0, set, and the docs/log entry its message names."""


def test_a_schema_2_artifact_with_the_removed_keys_off_reads_as_if_it_had_none():
    text = SCHEMA_2_PIPELINE.read_text()
    assert "schema_version: 2" in text and all(off in text for off, _, _ in REMOVED.values())
    read = pipeline_from_yaml(text, "a schema-2 artifact")
    without = text.replace("schema_version: 2", TODAY)
    for off, _, _ in REMOVED.values():
        without = without.replace(f"  {off}\n", "")
    assert read == pipeline_from_yaml(without, "the same, written today") and read.schema_version == 3
    assert pipeline_hash(read) == pipeline_hash(pipeline_from_yaml(without, "the same"))


@pytest.mark.parametrize("key", sorted(REMOVED))
def test_a_removed_key_is_refused_with_why_it_went_when_stored_set_and_when_a_user_names_it(key, tmp_path, capsys):
    """Set in a stored schema-2 pipeline, named in a config file or an override (at any value): one message with
    what the key did, that it measured worse, the log entry that measured it and what to do; exit 2."""
    from stack.cli import main

    off, on, log = REMOVED[key]
    why = rf"{key}.*It was removed in pipeline schema 3: it .*measured worse \(.*docs/log/\S*{log}.*Drop the key"
    with pytest.raises(ConfigError, match=why):
        pipeline_from_yaml(SCHEMA_2_PIPELINE.read_text().replace(off, on), "checkpoint x.safetensors")
    section, name = key.split(".")
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"{section}:\n  {name}: 0.0\n")
    with pytest.raises(ConfigError, match=f"unknown config key {key!r}. " + why.split(".*", 1)[1]):
        load_pipeline([DEFAULT, mine])
    with pytest.raises(ConfigError, match=why):
        load_pipeline([DEFAULT], [f"{key}=0.3"])
    assert main(["config", "-c", str(DEFAULT), f"{key}=0.3"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "measured worse" in err and "Traceback" not in err


def test_recorded_guard_settings_with_a_removed_rule_off_read_as_todays_and_on_are_refused():
    """A bundle's gate.json records the guard settings it ships (`GuardConfig.settings`): one written before
    schema 3 (a schema-2 card's) still reads; one that drove with a removed rule does not."""
    import json

    from stack.errors import StackError
    from stack.models.post_processing import guard_from_settings

    recorded = json.loads((SCHEMA_2 / "post_processing.json").read_text())["guard"]
    assert recorded["confirm_below"] == 0.0 and recorded["defer_below"] == 0.0
    stored = pipeline_from_yaml(SCHEMA_2_PIPELINE.read_text(), "a schema-2 artifact")
    assert guard_from_settings(recorded) == stored.guard
    assert schema.migrate_guard_settings(recorded) == stored.guard.settings()
    with pytest.raises(StackError, match="guard.confirm_below: 0.4. It was removed in pipeline schema 3"):
        guard_from_settings({**recorded, "confirm_below": 0.4})


def test_artifact_yaml_from_another_schema_is_refused():
    text = pipeline_to_yaml(load_pipeline([DEFAULT])).replace(TODAY, "schema_version: 99")
    with pytest.raises(ConfigError, match="schema_version"):
        pipeline_from_yaml(text, "checkpoint x.ckpt")


def _sections(cls):
    yield cls
    for hint in typing.get_type_hints(cls).values():
        for inner in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(inner):
                yield from _sections(inner)


@pytest.mark.parametrize("section", sorted({c for c in _sections(schema.Pipeline)}, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(section):
    docs = _field_docs(section)
    undocumented = [f.name for f in dataclasses.fields(section) if not docs.get(f.name)]
    assert not undocumented, f"{section.__name__} fields without a docstring: {undocumented}"


def test_describe_lists_keys_with_docs():
    text = describe("train.precision")
    assert "train.precision" in text and "bf16-mixed" in text


def test_describe_takes_a_concrete_target_name_for_the_schemas_name_placeholder():
    """`targets.orin.min_fps` is the key a user types; the schema calls it `targets.NAME.min_fps`."""
    assert "targets.NAME.min_fps" in describe("targets.orin.min_fps")
    assert "targets.NAME.closed_loop.inconclusive_passes" in describe("targets.ci-cpu.closed_loop")
    with pytest.raises(ConfigError, match="no config key"):
        describe("targets.orin.min_fpx")
