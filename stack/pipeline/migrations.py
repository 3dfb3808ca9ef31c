"""Reading artifacts written under an older pipeline schema: their stored YAML, moved to today's keys.

A checkpoint or bundle carries the resolved pipeline it was made with. When a key moves, the artifacts written
before keep working: `migrate` rewrites their stored tree, key by key, and a config file the user writes that still
names an old key is told where it went (`RENAMED_KEYS`, used by `stack.config`'s unknown-key error).
"""

from __future__ import annotations

import copy

SCHEMA_VERSION = 2
"""Bumped whenever a field is renamed or its meaning changes; artifacts record it. 2: the plan guard's settings left
`model.plan_guard_*` for the `guard` section."""

RENAMED_KEYS = {f"model.plan_guard_{name}": f"guard.{name}" for name in (
    "score", "deceleration", "confirm_below", "restart_s", "reaction_s", "defer_below", "segmentation", "depth")}
"""Old dotted key -> today's, for every key moved since schema 1."""


def migrate(tree: dict) -> dict:
    """`tree` (a stored pipeline's parsed YAML) under today's schema: a copy with every key of an older schema moved
    where it lives now; a tree of today's schema (or of an unknown one, which the caller refuses) is returned as is."""
    version = tree.get("schema_version", 1)
    if version != 1:
        return tree
    moved = copy.deepcopy(tree)
    model = moved.get("model") if isinstance(moved.get("model"), dict) else {}
    guard = moved.setdefault("guard", {}) if isinstance(moved.get("guard", {}), dict) else None
    for old, new in RENAMED_KEYS.items():
        name = old.split(".", 1)[1]
        if name in model and guard is not None:
            guard[new.split(".", 1)[1]] = model.pop(name)
    moved["schema_version"] = SCHEMA_VERSION
    return moved
