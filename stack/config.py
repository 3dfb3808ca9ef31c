"""Loading the pipeline: schema ← YAML files ← `key=value` overrides → a validated `Pipeline`.

Everything that can be wrong with a configuration is found here, before any work
starts, and reported as a `ConfigError` that names the full dotted key, the value,
what is allowed, and where the value came from (which file, or the command line).

The resolved pipeline serialises back to YAML (`pipeline_to_yaml`) with a content
hash (`pipeline_hash`); artifacts store that YAML so `pipeline_from_yaml` can
rebuild exactly the object that made them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import os
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from stack.errors import ConfigError, missing_file_message
from stack.pipeline import Pipeline, Target

CONFIG_DIR = Path(os.environ.get("STACK_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))
"""The repository's `configs/` folder (override with STACK_CONFIG_DIR)."""
DEFAULT_CONFIG = CONFIG_DIR / "pipeline.yaml"
TARGETS_DIR = CONFIG_DIR / "targets"


# ------------------------------------------------------------------ public API


def load_pipeline(files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Pipeline:
    """Merge `files` (in order) and then `overrides` onto the schema and validate.

    With no files, `configs/pipeline.yaml` is used. Every `configs/targets/*.yaml`
    is loaded first as `targets.<file stem>`, so targets can be overridden
    (`targets.orin.min_fps=30`) like any other key.
    """
    config = OmegaConf.structured(Pipeline)
    for path in sorted(TARGETS_DIR.glob("*.yaml")) if TARGETS_DIR.is_dir() else ():
        config.targets[path.stem] = _load_target_node(path)
    for path in files or [DEFAULT_CONFIG]:
        config = _merge_file(config, Path(path))
    for text in overrides:
        _apply_override(config, text)
    return _to_pipeline(config, source="the merged configuration")


def pipeline_to_yaml(pipeline: Pipeline) -> str:
    """The resolved pipeline as YAML: the text every artifact carries."""
    return OmegaConf.to_yaml(OmegaConf.structured(pipeline))


def pipeline_from_yaml(text: str, source: str) -> Pipeline:
    """Rebuild a pipeline from the YAML an artifact carries; `source` names it in errors."""
    config = OmegaConf.structured(Pipeline)
    config = _merge_mapping(config, _parse_yaml(text, source), source)
    return _to_pipeline(config, source)


def pipeline_hash(pipeline: Pipeline) -> str:
    """Short content hash of the resolved pipeline (sha256 of its YAML)."""
    return hashlib.sha256(pipeline_to_yaml(pipeline).encode()).hexdigest()[:16]


def load_target(name: str, pipeline: Pipeline) -> Target:
    """The deploy target called `name`, or an error listing the known ones."""
    if name in pipeline.targets:
        return pipeline.targets[name]
    known = ", ".join(sorted(pipeline.targets)) or "none"
    near = difflib.get_close_matches(name, list(pipeline.targets), n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise ConfigError(
        f"unknown target {name!r}.{hint} Known targets: {known}. "
        f"Add one as {TARGETS_DIR}/{name}.yaml or under `targets.{name}` in a config file."
    )


def describe(prefix: str = "") -> str:
    """One line per schema key under `prefix`: key, type, default, and its docstring."""
    rows = [(key, _type_name(hint), default, doc) for key, hint, default, doc in _schema_keys(Pipeline, "")
            if key == prefix or key.startswith(prefix + ".") or not prefix]
    if not rows:
        raise ConfigError(f"no config key {prefix!r}.{_nearest_hint(prefix)}")
    width = max(len(key) for key, *_ in rows)
    return "\n".join(f"{key:<{width}}  {kind} = {default!r}\n{'':<{width}}  {doc}" for key, kind, default, doc in rows)


# ------------------------------------------------------------- merging steps


def _parse_yaml(text: str, source: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping of config keys at the top level; found a {type(data).__name__}.")
    return data


def _read_config_file(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(missing_file_message(
            "config file", path,
            f"Pass an existing YAML file with -c, e.g. -c {DEFAULT_CONFIG.relative_to(CONFIG_DIR.parent)}."))
    return _parse_yaml(path.read_text(), f"config file {str(path)!r}")


def _merge_file(config: DictConfig, path: Path) -> DictConfig:
    return _merge_mapping(config, _read_config_file(path), f"config file {str(path)!r}")


def _merge_mapping(config: DictConfig, data: dict, source: str) -> DictConfig:
    for name, value in (data.get("targets") or {}).items() if isinstance(data.get("targets"), dict) else ():
        if name not in config.targets:  # a new target starts from the Target defaults
            config.targets[name] = OmegaConf.structured(Target)
    try:
        return OmegaConf.merge(config, data)
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        key = str(getattr(exc, "full_key", None) or "")
        raise _explain(exc, source, full_key=_locate(data, key)) from None


def _locate(data: Any, key: str, prefix: str = "") -> str | None:
    """Full dotted path in `data` that ends with `key`: OmegaConf loses the path inside lists."""
    if not key or "." in key:
        return key or None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for name, value in items:
        path = _join(prefix, str(name))
        if str(name) == key:
            return path
        found = _locate(value, key, path)
        if found and found != key:
            return found
    return None


def _load_target_node(path: Path) -> DictConfig:
    node = OmegaConf.structured(Target)
    source = f"target file {str(path)!r}"
    try:
        return OmegaConf.merge(node, _read_config_file(path))
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        raise _explain(exc, source, prefix=f"targets.{path.stem}") from None


def _apply_override(config: DictConfig, text: str) -> None:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"override {text!r} is not of the form key=value. "
            f"Write e.g. train.max_epochs=10 (run `stack config --describe` to list keys)."
        )
    source = f"the command-line override {text!r}"
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"{source}: cannot parse the value {raw!r} as YAML. Quote it, e.g. {key}='{raw}'.") from None
    _check_path_exists(config, key, source)
    try:
        OmegaConf.update(config, key, value, merge=True)
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        raise _explain(exc, source, full_key=key) from None


def _check_path_exists(config: DictConfig, key: str, source: str) -> None:
    """Catch unknown keys, list indices out of range and unknown targets before OmegaConf does."""
    node: Any = config
    walked: list[str] = []
    for part in key.split("."):
        here = ".".join(walked + [part])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"{source}: {here!r} is not an element of {'.'.join(walked)!r}, which has "
                    f"{len(node)} entries (indices 0..{len(node) - 1}). Use an index in range, "
                    f"or set the whole list in a config file."
                )
            node = node[int(part)]
        elif isinstance(node, DictConfig):
            if part not in node:
                if walked == ["targets"]:
                    raise ConfigError(
                        f"{source}: there is no target named {part!r}; known targets: "
                        f"{', '.join(sorted(node)) or 'none'}. Define a new target in a config file."
                    )
                raise ConfigError(f"{source}: unknown config key {here!r}.{_nearest_hint(here)}")
            node = node._get_node(part)
        else:
            return  # setting a sub-key of a leaf: OmegaConf reports the type error
        walked.append(part)


# ---------------------------------------------------------------- validation


def _to_pipeline(config: DictConfig, source: str) -> Pipeline:
    missing = sorted(OmegaConf.missing_keys(config))
    if missing:
        raise ConfigError(f"{source} leaves required keys unset: {', '.join(missing)}. Give each a value.")
    try:
        pipeline = OmegaConf.to_object(config)
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        raise _explain(exc, source) from None
    problems = list(_walk_problems(pipeline, ""))
    if problems:
        lines = [f"  {key}: {message}" for key, message in problems]
        noun = "value" if len(problems) == 1 else f"{len(problems)} values"
        raise ConfigError(f"invalid {noun} in {source}:\n" + "\n".join(lines)
                          + "\nFix each key in your config file or override it with key=value.")
    return pipeline


def _walk_problems(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """Every section's `problems()`, named by full dotted key (list items by index)."""
    if dataclasses.is_dataclass(node):
        for name, message in node.problems():
            yield _join(prefix, name), message
        for f in dataclasses.fields(node):
            yield from _walk_problems(getattr(node, f.name), _join(prefix, f.name))
    elif isinstance(node, dict):
        for name, value in node.items():
            yield from _walk_problems(value, _join(prefix, str(name)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk_problems(value, _join(prefix, str(index)))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _explain(exc: Exception, source: str, full_key: str | None = None, prefix: str = "") -> ConfigError:
    """Turn an OmegaConf error into: which key, what was found, what is allowed."""
    key = full_key or getattr(exc, "full_key", None) or ""
    key = key.replace("[", ".").replace("]", "")
    if prefix and not key.startswith(prefix):
        key = _join(prefix, key)
    message = str(getattr(exc, "msg", exc)).split("\n")[0]
    if "not in" in message and ("Key '" in message):
        return ConfigError(f"{source}: unknown config key {key!r}.{_nearest_hint(key)}")
    expected = _expected(getattr(exc, "object_type", None), getattr(exc, "key", None))
    found = f" ({message})" if message else ""
    return ConfigError(f"{source}: bad value for {key!r}{found}. Expected {expected}.")


def _expected(owner: Any, name: Any) -> str:
    if not (isinstance(owner, type) and dataclasses.is_dataclass(owner) and isinstance(name, str)):
        return "a value of the type the schema declares (see `stack config --describe`)"
    hints = typing.get_type_hints(owner)
    if name not in hints:
        return "a value of the type the schema declares (see `stack config --describe`)"
    doc = _field_docs(owner).get(name, "")
    return f"{_type_name(hints[name])}" + (f" ({doc.rstrip('.')})" if doc else "")


# ------------------------------------------------------------ schema helpers


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        return f"{_type_name(inner)} or null"
    if origin in (list, typing.List):
        return f"a list of {_type_name(args[0]).removeprefix('an ').removeprefix('a ')}s"
    if origin in (dict, typing.Dict):
        return f"a mapping of names to {_type_name(args[1]).removeprefix('a ')}"
    if dataclasses.is_dataclass(hint):
        return f"a {hint.__name__} section"
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}.get(hint, str(hint))


@lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _schema_keys(cls: type, prefix: str) -> Iterator[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, doc) for every leaf and section of the schema."""
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        key, hint = _join(prefix, f.name), hints[f.name]
        default = getattr(instance, f.name)
        if dataclasses.is_dataclass(hint):
            yield key, hint, "{...}", docs.get(f.name, "")
            yield from _schema_keys(hint, key)
        else:
            yield key, hint, default if not dataclasses.is_dataclass(type(default)) else "{...}", docs.get(f.name, "")
        element = typing.get_args(hint)[-1] if typing.get_origin(hint) in (list, dict) else None
        if element is not None and dataclasses.is_dataclass(element):
            marker = "N" if typing.get_origin(hint) is list else "NAME"
            yield from _schema_keys(element, f"{key}.{marker}")


@lru_cache(maxsize=1)
def _all_keys() -> tuple[str, ...]:
    return tuple(key for key, *_ in _schema_keys(Pipeline, ""))


def _nearest_hint(key: str) -> str:
    """' Nearest valid keys: …' for a mistyped dotted key, matching list indices and names loosely."""
    parts = key.split(".")
    generic = ".".join("N" if p.isdigit() else p for p in parts)
    if len(parts) > 2 and parts[0] == "targets":
        generic = ".".join(["targets", "NAME"] + parts[2:])
    candidates = _all_keys()
    parent = generic.rpartition(".")[0]
    siblings = [k for k in candidates if k.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(generic, candidates, n=3, cutoff=0.6)
    near = _restore(near, parts)
    where = f"under {parent!r}" if parent else "at the top level"
    listing = f" Valid keys {where}: {', '.join(k.rpartition('.')[2] for k in siblings)}." if siblings else ""
    if not near:
        return listing or " Run `stack config --describe` to list every key."
    return f" Nearest valid key{'s' if len(near) > 1 else ''}: {', '.join(near)}.{listing}"


def _restore(keys: list[str], parts: list[str]) -> list[str]:
    """Put the user's list indices / target names back into generic keys (N, NAME)."""
    restored = []
    for key in keys:
        out = [parts[i] if p in ("N", "NAME") and i < len(parts) else p for i, p in enumerate(key.split("."))]
        restored.append(".".join(out))
    return restored
