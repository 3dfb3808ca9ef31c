"""Reading artifacts written under an older pipeline schema: their stored YAML, moved to today's keys.

A checkpoint or bundle carries the resolved pipeline it was made with. When a key moves or goes, the artifacts
written before keep working: `migrate` rewrites their stored tree, key by key, and a config file the user writes that
still names an old key is told where it went (`RENAMED_KEYS`) or why it is gone (`REMOVED_KEYS`), both through
`stack.config`'s unknown-key error (`key_history`).
"""

from __future__ import annotations

import copy

from stack.errors import ConfigError

SCHEMA_VERSION = 3
"""Bumped whenever a field is renamed, removed or its meaning changes; artifacts record it. 2: the plan guard's
settings left `model.plan_guard_*` for the `guard` section. 3: three experiment switches that no preset set and
that measured worse were removed (`REMOVED_KEYS`)."""

READABLE_SCHEMAS = (1, 2, SCHEMA_VERSION)
"""Pipeline schemas a stored pipeline may carry: the older ones `migrate` moves to today's keys."""

RENAMED_KEYS = {f"model.plan_guard_{name}": f"guard.{name}" for name in (
    "score", "deceleration", "restart_s", "reaction_s", "segmentation", "depth")}
"""Old dotted key -> today's, for every key moved since schema 1 and still here."""

REMOVED_KEYS = {
    "guard.confirm_below": (
        "braked for a detection scoring under it only once the previous replan saw it too",
        "drives ended by a collision 11 -> 19-21 at every setting tried", "docs/log/2026-11-27_guard-restart-confirmation.md"),
    "guard.defer_below": (
        "held detections scoring under it to the room-to-stop rule only",
        "with room to stop 0.6 s, tuning DS +0.007 within noise, PDMS -0.046, collisions +0.018 an episode",
        "docs/log/2026-11-29_room-to-stop.md"),
    "model.planning_stop_deceleration": (
        "labelled a path-speed candidate a collision when it could not stop at that rate after its horizon",
        "trained at 3.5 on one seed it did not help: held-out DS 0.691, PDMS 0.313; guard.reaction_s keeps room to "
        "stop instead", "docs/log/2026-11-27_plan-guard.md"),
}
"""Dotted key removed in schema 3 -> (what it did, what it measured, the docs/log entry that measured it). A stored
pipeline that has one at its off value (0) reads as if it had none; one that sets it is refused."""
REMOVED_KEYS.update({f"model.plan_guard_{name}": REMOVED_KEYS[f"guard.{name}"]
                     for name in ("confirm_below", "defer_below")})  # their schema-1 names
REMOVED_IN = 3
"""The schema that removed `REMOVED_KEYS`."""


def key_history(key: str) -> str | None:
    """Where an old dotted key went, or why it is gone, as one sentence; None for a key that never existed."""
    if key in RENAMED_KEYS:
        return f"It moved to {RENAMED_KEYS[key]!r} in pipeline schema 2: write that key instead."
    if key in REMOVED_KEYS:
        did, measured, log = REMOVED_KEYS[key]
        return (f"It was removed in pipeline schema {REMOVED_IN}: it {did}, and it measured worse ({measured}; "
                f"{log}). Drop the key, or run the stack version that had it (one that writes pipeline schema 2).")
    return None


def is_off(value) -> bool:
    """Whether a removed setting's stored value is its off value (0): what it read as before it was removed."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def migrate(tree: dict, source: str = "a stored pipeline") -> dict:
    """`tree` (a stored pipeline's parsed YAML) under today's schema: a copy with every key of an older schema moved
    where it lives now and every removed key at its off value dropped; a ConfigError naming `source` for a removed key
    set to anything else (the artifact drove with a rule this stack no longer has). A tree of today's schema (or of
    an unknown one, which the caller refuses) is returned as is."""
    version = tree.get("schema_version", 1)
    if version == SCHEMA_VERSION or version not in READABLE_SCHEMAS:
        return tree
    moved = copy.deepcopy(tree)
    for key in REMOVED_KEYS:
        section, name = key.split(".", 1)
        node = moved.get(section)
        if isinstance(node, dict) and name in node:
            if not is_off(node[name]):
                raise ConfigError(f"{source} sets {key}: {node[name]!r}. {key_history(key)}")
            del node[name]
    if version == 1:
        model = moved.get("model") if isinstance(moved.get("model"), dict) else {}
        guard = moved.setdefault("guard", {}) if isinstance(moved.get("guard", {}), dict) else None
        for old, new in RENAMED_KEYS.items():
            name = old.split(".", 1)[1]
            if name in model and guard is not None:
                guard[new.split(".", 1)[1]] = model.pop(name)
    moved["schema_version"] = SCHEMA_VERSION
    return moved


def migrate_guard_settings(settings, source: str = "recorded plan guard settings"):
    """Recorded guard settings (`GuardConfig.settings`: a bundle's gate.json, a drive record) under today's keys: the
    removed ones (`REMOVED_KEYS` under `guard.`) dropped at their off value, a ConfigError naming `source` when one
    is set; anything but a mapping is returned as is for the caller to refuse."""
    if not isinstance(settings, dict):
        return settings
    found = dict(settings)
    for key in REMOVED_KEYS:
        section, name = key.split(".", 1)
        if section == "guard" and name in found:
            if not is_off(found[name]):
                raise ConfigError(f"{source} set {key}: {found[name]!r}. {key_history(key)}")
            del found[name]
    return found
