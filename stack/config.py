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
import math
import re
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from stack import safe_values
from stack.errors import ConfigError, missing_file_message
from stack.pipeline import Pipeline, Target, key_history, migrate

from stack.pipeline.target_config import CONFIG_DIR, TARGETS_DIR

DEFAULT_CONFIG = CONFIG_DIR / "pipeline.yaml"
FOLDER_KEYS = ("data.root", "train.out_dir", "export.out_dir")
"""Keys naming folders the stages create: an existing file there is refused up front."""


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without the YAML 1.1 readings that surprise in a config.

    YAML 1.1 reads `12:00:00` as the base-60 integer 43200 (and `1:30.5` as a float) and
    `2026-01-01` as a date; YAML 1.2 dropped both. Here such values stay strings, so
    `train.slurm_time=12:00:00` is the time the user wrote. Other numbers (`0x10`, `1_000`,
    `1e3`, `.inf`) and booleans read as YAML 1.1 reads them.
    """


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _sexagesimal in (("int", r"|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+"),
                           ("float", r"|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*")):
    for _first, _resolvers in ConfigLoader.yaml_implicit_resolvers.items():
        _resolvers[:] = [(tag, re.compile(regexp.pattern.replace(_sexagesimal, ""), regexp.flags))
                         if tag == f"tag:yaml.org,2002:{_tag}" else (tag, regexp) for tag, regexp in _resolvers]


MERGE_ERRORS = (OmegaConfBaseException, TypeError, ValueError, OverflowError, RecursionError)
"""What OmegaConf raises for a value that does not fit the schema (an int too large for a float included)."""
YAML_ERRORS = (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError)
"""What reading YAML can raise: syntax errors, and constructor errors for tags like `!!int x`."""


def parse_yaml_value(text: str):
    """One YAML value (an override's right-hand side, or a whole file) read with `ConfigLoader`.

    The document is composed first and its size with every alias expanded counted before anything is
    built from it: a `YamlTooLargeError` (a ValueError) for an alias bomb, whatever it would expand to.
    """
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        value = loader.construct_document(node)
    finally:
        loader.dispose()
    _check_nesting(value, ())
    return value


MAX_NESTING = 32
"""Deepest nesting a config value may have (the schema's deepest key is 5 levels down)."""
MAX_YAML_NODES = 10_000
"""Most values (keys, scalars, lists, mappings) a YAML document may expand to once its aliases are followed.
A whole resolved pipeline is about 830; nine nested anchors of nine aliases each ("billion laughs") are 9**9."""


class YamlTooLargeError(ValueError):
    """A YAML document whose aliases expand it beyond `MAX_YAML_NODES`: refused before it is built."""


def _check_expanded_size(root: yaml.Node) -> None:
    """Count `root`'s values as if every alias were copied out, each shared node once per use (memoised,
    so a bomb costs as many steps as it has anchors); stop as soon as the count passes the bound."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise ValueError("a YAML alias refers to a node that contains it (an endless value)")
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise YamlTooLargeError(
                    f"expands to more than {MAX_YAML_NODES:,} values once its aliases (*name) are followed "
                    f"(a whole pipeline has under 1,000): an alias bomb (\"billion laughs\"), refused before "
                    f"it is expanded")
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    size(root)


def _check_nesting(value: Any, inside: tuple) -> None:
    """Nesting hundreds deep overflows OmegaConf's recursion: a ValueError here. (An alias to its own
    ancestor, `&a [*a]`, never gets this far: `_check_expanded_size` refuses it.)"""
    if isinstance(value, (dict, list)):
        if len(inside) >= MAX_NESTING:
            raise ValueError(f"the value is nested more than {MAX_NESTING} levels deep")
        for item in value.values() if isinstance(value, dict) else value:
            _check_nesting(item, inside + (id(value),))


INTERPOLATION = re.compile(r"\$\{([^}]*)\}?")
"""An OmegaConf interpolation (`${data.root}`, `${oc.env:HOME}`) inside a string value."""
REFERENCE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
"""What a user config may interpolate: another key of the pipeline (`${data.root}`), nothing else."""


def check_interpolations(value: Any, source: str, stored: bool, key: str = "") -> None:
    """User configs may refer to other keys (`train.out_dir: ${data.root}/train`); no config calls a resolver
    (`${oc.env:HOME}` would copy the environment into every artifact), and a pipeline stored in an artifact
    (a checkpoint, a bundle) holds resolved values only, so any interpolation in one is refused: the file was
    edited or crafted."""
    if isinstance(value, dict):
        for name, item in value.items():
            check_interpolations(item, source, stored, _join(key, str(name)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_interpolations(item, source, stored, _join(key, str(index)))
    elif isinstance(value, str):
        for found in INTERPOLATION.finditer(value):
            _check_interpolation(found.group(0), found.group(1), source, stored, key or "the value")


def _check_interpolation(text: str, inner: str, source: str, stored: bool, key: str) -> None:
    if stored:
        raise ConfigError(f"{source}: {key} holds the interpolation {text[:80]!r}; a pipeline stored by `stack` "
                          "holds resolved values only, so this one was edited or crafted. Use the artifact "
                          "`stack` wrote, or give the configuration with -c")
    if not REFERENCE.fullmatch(inner):
        raise ConfigError(f"{source}: {key} holds {text[:80]!r}; a config may interpolate another key "
                          "(e.g. ${data.root}/train), never call a resolver such as oc.env. Write the value itself")


# ------------------------------------------------------------------ public API


def load_pipeline(files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Pipeline:
    """Merge `files` (in order) and then `overrides` onto the schema and validate.

    With no files, `configs/pipeline.yaml` is used. Every `configs/targets/*.yaml`
    is loaded first as `targets.<file stem>`, so targets can be overridden
    (`targets.orin.min_fps=30`) like any other key.
    """
    return apply_overrides(base_config(files), overrides)


def base_config(files: Sequence[str | Path] = ()) -> DictConfig:
    """The schema with the target files and then `files` (default configs/pipeline.yaml) merged, unvalidated."""
    config = OmegaConf.structured(Pipeline)
    for path in sorted(TARGETS_DIR.glob("*.yaml")) if TARGETS_DIR.is_dir() else ():
        config.targets[path.stem] = _load_target_node(path)
    for path in files or [DEFAULT_CONFIG]:
        config = _merge_file(config, Path(path))
    return config


def apply_overrides(config: DictConfig, overrides: Sequence[str]) -> Pipeline:
    """`key=value` overrides applied to `config` (changed in place), then the validated Pipeline."""
    for text in overrides:
        _apply_override(config, text)
    pipeline = _to_pipeline(config, source="the merged configuration")
    _check_folders(pipeline)
    return pipeline


def pipeline_to_yaml(pipeline: Pipeline) -> str:
    """The resolved pipeline as YAML: the text every artifact carries."""
    return OmegaConf.to_yaml(OmegaConf.structured(pipeline))


def pipeline_from_yaml(text: str, source: str) -> Pipeline:
    """Rebuild a pipeline from the YAML an artifact carries; `source` names it in errors."""
    config = OmegaConf.structured(Pipeline)
    data = migrate(_parse_yaml(text, source, stored=True), source)  # an artifact of an older schema: today's keys
    check_interpolations(data, source, stored=True)
    config = _merge_mapping(config, data, source)
    return _to_pipeline(config, source)


def pipeline_hash(pipeline: Pipeline) -> str:
    """Short content hash of the resolved pipeline (sha256 of its YAML)."""
    return yaml_hash(pipeline_to_yaml(pipeline))


def yaml_hash(text: str) -> str:
    """`pipeline_hash` of the pipeline whose `pipeline_to_yaml` is `text` (saves serialising twice)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_target_name(name: str, source: str) -> None:
    """A target name becomes a folder under export.out_dir: refuse anything but an identifier."""
    message = safe_values.identifier(name)
    if message:
        raise ConfigError(f"{source}: bad target name: {message}.")


def load_target(name: str, pipeline: Pipeline) -> Target:
    """The deploy target called `name`, or an error listing the known ones."""
    check_target_name(name, "--target")
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
            if not prefix or _under(key, prefix)]
    if not rows:
        raise ConfigError(f"no config key {prefix!r}.{_nearest_hint(prefix)}")
    width = max(len(key) for key, *_ in rows)
    return "\n".join(f"{key:<{width}}  {kind} = {default!r}\n{'':<{width}}  {doc}" for key, kind, default, doc in rows)


def _under(key: str, prefix: str) -> bool:
    """Whether schema `key` (with NAME / N placeholders) is `prefix` or below it; `prefix` may name a concrete
    target or list index there (`targets.orin.min_fps` is `targets.NAME.min_fps`)."""
    wanted, parts = prefix.split("."), key.split(".")
    return len(parts) >= len(wanted) and all(
        part == word or (part == "NAME" and word) or (part == "N" and word.isdigit())
        for part, word in zip(parts, wanted))


# ------------------------------------------------------------- merging steps


def _parse_yaml(text: str, source: str, stored: bool = False) -> dict:
    try:
        data = parse_yaml_value(text)
    except YamlTooLargeError as exc:
        fix = ("`stack` never writes anchors, so this one was edited or crafted: use the artifact `stack` wrote"
               if stored else "Write the values out without nested anchors (&name)")
        raise ConfigError(f"{source} {exc}. {fix}.") from None
    except YAML_ERRORS as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping of config keys at the top level; found a {type(data).__name__}.")
    return data


def _read_config_file(path: Path) -> dict:
    """The mapping in a YAML config file; a missing, unreadable, non-UTF-8 or empty file is an error.

    An empty file is refused rather than read as "no keys": `-c FILE` replaces
    configs/pipeline.yaml, so an empty (or all-comment) file would silently run the
    bare schema defaults instead of the default pipeline.
    """
    example = f"-c {DEFAULT_CONFIG.relative_to(CONFIG_DIR.parent)}"
    if not path.exists() or path.is_dir():
        raise ConfigError(missing_file_message("config file", path, f"Pass an existing YAML file with -c, e.g. {example}."))
    source = f"config file {str(path)!r}"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read ({exc.strerror or exc}). Check its permissions, "
                          f"or pass a readable YAML file with -c.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                          "a config file is YAML in UTF-8. Convert it (e.g. iconv -t UTF-8) or pass the right file."
                          ) from None
    data = _parse_yaml(text, source)
    if not data:
        raise ConfigError(f"{source} is empty (it sets no keys). An empty -c file would replace "
                          f"configs/pipeline.yaml with the bare schema defaults; put keys in it, or leave it out "
                          f"(no -c uses configs/pipeline.yaml).")
    return data


def _merge_file(config: DictConfig, path: Path) -> DictConfig:
    data, source = _read_config_file(path), f"config file {str(path)!r}"
    check_interpolations(data, source, stored=False)
    return _merge_mapping(config, data, source)


def _merge_mapping(config: DictConfig, data: dict, source: str) -> DictConfig:
    _check_shape(data, Pipeline, "", source)
    for name, value in (data.get("targets") or {}).items() if isinstance(data.get("targets"), dict) else ():
        if name not in config.targets:  # a new target starts from the Target defaults
            config.targets[name] = OmegaConf.structured(Target)
    try:
        return OmegaConf.merge(config, data)
    except MERGE_ERRORS as exc:
        key = str(getattr(exc, "full_key", None) or "")
        raise _explain(exc, source, full_key=_locate(data, key)) from None


def _check_shape(data: Any, hint: Any, key: str, source: str) -> None:
    """Refuse a section given as a scalar, a scalar given as a list, a non-string name...: OmegaConf's
    own errors for these lose the key ("bad value for ''")."""
    found = _shape_problem(data, hint, key)
    if found:
        where, expected, value = found
        raise ConfigError(f"{source}: bad value for {where or 'the top level'!r}: expected {expected}, found {value}.")


def _shape_problem(data: Any, hint: Any, key: str) -> tuple[str, str, str] | None:
    """(dotted key, what was expected, what was found) of the first value whose shape does not fit `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        return None if data is None else _shape_problem(data, [a for a in args if a is not type(None)][0], key)
    if dataclasses.is_dataclass(hint) or origin in (dict, typing.Dict):
        if not isinstance(data, dict):
            section = " (a mapping of its keys)" if dataclasses.is_dataclass(hint) else ""
            return key, _type_name(hint) + section, _describe_value(data)
        hints = _type_hints(hint) if dataclasses.is_dataclass(hint) else {}
        for name, value in data.items():
            if not isinstance(name, str):
                return _join(key, str(name)), "names (string keys)", f"the key {name!r}"
            inner = hints.get(name) if hints else args[1]
            found = _shape_problem(value, inner, _join(key, name)) if inner is not None else None
            if found:
                return found
        return None
    if origin in (list, typing.List):
        if not isinstance(data, list):
            return key, _type_name(hint), _describe_value(data)
        return next(filter(None, (_shape_problem(v, args[0], _join(key, str(i))) for i, v in enumerate(data))), None)
    if isinstance(data, (dict, list)):
        return key, _type_name(hint), _describe_value(data)
    return None


def _describe_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return "null" if value is None else repr(value)[:60]


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
    data = _read_config_file(path)
    _check_shape(data, Target, f"targets.{path.stem}", source)
    try:
        return OmegaConf.merge(node, data)
    except MERGE_ERRORS as exc:
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
        value = parse_yaml_value(raw) if raw.strip() else ""
    except YamlTooLargeError as exc:
        raise ConfigError(f"{source}: the value {exc}. Write the value out without nested anchors (&name).") from None
    except YAML_ERRORS:
        raise ConfigError(f"{source}: cannot parse the value {raw!r} as YAML. For a string, quote it in YAML inside "
                          f"the shell's quotes, e.g. {key}='\"...\"'; control characters are never allowed.") from None
    check_interpolations(value, source, stored=False, key=key)
    _check_path_exists(config, key, source)
    try:
        OmegaConf.update(config, key, value, merge=True)
    except MERGE_ERRORS as exc:
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
    try:
        missing = sorted(OmegaConf.missing_keys(config))
    except InterpolationResolutionError as exc:
        raise _unresolved(exc, source) from None
    if missing:
        raise ConfigError(f"{source} leaves required keys unset: {', '.join(missing)}. Give each a value.")
    try:
        pipeline = OmegaConf.to_object(config)
    except InterpolationResolutionError as exc:
        raise _unresolved(exc, source) from None
    except MERGE_ERRORS as exc:
        raise _explain(exc, source) from None
    problems = list(_walk_problems(pipeline, ""))
    if problems:
        lines = [f"  {key}: {message}" for key, message in problems]
        noun = "value" if len(problems) == 1 else f"{len(problems)} values"
        raise ConfigError(f"invalid {noun} in {source}:\n" + "\n".join(lines)
                          + "\nFix each key in your config file or override it with key=value.")
    return pipeline


def _check_folders(pipeline: Pipeline) -> None:
    """A folder key whose path (or one of its parents) is an existing file fails later, deep in a stage."""
    for key in FOLDER_KEYS:
        section, name = key.split(".")
        check_folder(key, getattr(getattr(pipeline, section), name))


def check_folder(key: str, value: str) -> None:
    """ConfigError unless `value` (the folder key `key`) can be a folder: neither it nor a parent is a file."""
    path = Path(value)
    try:
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={value[:80]!r} cannot be used as a folder ({exc}); "
                          "give a shorter, plain path.") from None
    if blocking is not None:
        what = "is a file" if blocking == path else f"lies under {str(blocking)!r}, which is a file"
        raise ConfigError(f"{key}={value!r} {what}; {key} names a folder (created when missing). "
                          f"Point it at a folder, or move the file away.")


def _walk_problems(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """Every section's `problems()` and every leaf's rules, named by full dotted key (list items by index)."""
    if dataclasses.is_dataclass(node):
        misshapen = list(_element_problems(node, prefix))
        yield from misshapen  # problems() assumes the declared element types: it runs only when they hold
        reported = set()
        for name, message in [] if misshapen else node.problems():
            reported.add(name)
            yield _join(prefix, name), message
        for f in dataclasses.fields(node):  # a leaf its section already reported needs no second message
            value = getattr(node, f.name)
            if f.name not in reported or isinstance(value, (dict, list)) or dataclasses.is_dataclass(value):
                yield from _walk_problems(value, _join(prefix, f.name))
    elif isinstance(node, dict):
        for name, value in node.items():
            yield from _walk_problems(value, _join(prefix, str(name)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk_problems(value, _join(prefix, str(index)))
    else:
        yield from _leaf_problems(node, prefix)


def _element_problems(section: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """Items of List[str]/Dict[str, float]-style fields that are not of the element type.

    OmegaConf accepts a nested list as an element of a List[str] (`train.slurm_extra=[[]]`).
    """
    primitives = (str, int, float, bool)
    for name, hint in _type_hints(type(section)).items():
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin not in (list, dict) or not args or args[-1] not in primitives:
            continue
        value = getattr(section, name)
        items = enumerate(value) if origin is list else value.items()
        for index, item in items:
            if not isinstance(item, args[-1]) and not (args[-1] is float and isinstance(item, int)):
                yield _join(prefix, f"{name}.{index}"), f"got {item!r}; expected {_type_name(args[-1])}"


@lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _leaf_problems(value: Any, key: str) -> Iterator[tuple[str, str]]:
    """Rules for every value of its type: strings hold no control characters, numbers are finite."""
    if isinstance(value, str):
        message = safe_values.control_characters(value)
        if message:
            yield key, message
    elif isinstance(value, float) and not math.isfinite(value):
        yield key, f"got {value!r}; must be a finite number"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unresolved(exc: InterpolationResolutionError, source: str) -> ConfigError:
    """An interpolation naming a key the pipeline does not have, or one that refers to itself."""
    key = str(getattr(exc, "full_key", "") or "a key")
    message = str(getattr(exc, "msg", exc)).split("\n")[0]
    return ConfigError(f"{source}: {key} interpolates a value that cannot be resolved ({message}). Refer to an "
                       "existing key (`stack config --describe` lists them), or write the value itself")


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
    found = f" ({message})" if message and message != "None" else ""
    where = repr(key) if key else "a key OmegaConf did not name"
    return ConfigError(f"{source}: bad value for {where}{found}. Expected {expected}.")


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
    """' Nearest valid keys: …' for a mistyped dotted key, matching list indices and names loosely; where a key
    moved or went (`stack.pipeline.key_history`), where and why."""
    history = key_history(key)
    if history:
        return f" {history}"
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
