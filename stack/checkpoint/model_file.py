"""The model checkpoint contract between `stack train` and `stack export`/`stack deploy`.

A checkpoint is what the trainer leaves behind and the only thing deploy starts from,
so it carries the resolved pipeline YAML that made it (and its hash): deploy rebuilds
exactly that network through `stack.models`, never through the trainer.

Three formats are read:

- the plain format written by `save_model_checkpoint` (a dict with `format` =
  "stack-model", `pipeline_yaml`, `pipeline_hash`, `schema_version`, `state_dict`,
  `extra`, and the lineage records `dataset` and `tracking` of `stack.lineage`), written atomically (temp file, then `os.replace`) so a crash never leaves
  half a file where a good checkpoint was;
- a Lightning `.ckpt` whose LightningModule stored `pipeline_yaml` (and
  `pipeline_hash`) in the checkpoint dict (`on_save_checkpoint`) or in its
  `hyper_parameters`; the `model.` prefix of its state-dict keys is stripped;
- a `.safetensors` file written by `save_safetensors_checkpoint` (the pinned reference network, `stack.deploy
  .reference`): the weights as safetensors, the plain format's other keys as JSON in its metadata header. It
  loads without unpickling anything at all.

A resumable checkpoint folder (`checkpoints/step-*.ckpt`, `stack.checkpoint.sharded`) is read as the Lightning
format, so a run stopped before it wrote model.pt is evaluated, exported and deployed from its newest checkpoint.

All are read with `torch.load(weights_only=True)` and nothing else: a pickle can name
any callable (`os.system` in `__reduce__`) and unpickling runs it, so a file that needs
more than tensors, numbers, strings and containers is refused, never retried unsafely
(https://pytorch.org/docs/stable/notes/serialization.html#weights-only). Everything
`stack train` writes (model.pt; the .ckpt with AdamW, LR schedule, loop and RNG state)
loads this way.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


from stack.errors import StackError, missing_file_message
from stack.pipeline import READABLE_SCHEMAS, SCHEMA_VERSION, Pipeline

FORMAT = "stack-model"
"""Value of the `format` key of a plain checkpoint."""
MODEL_PREFIX = "model."
"""Prefix of the network's weights inside a Lightning checkpoint's state_dict."""
MODEL_SECTIONS = ("model", "data.rig")
"""Pipeline sections that define the network's weights and inputs: they must agree
between a checkpoint and the pipeline it is deployed with. The plan's post-processing (`guard`) is not among them:
a checkpoint drives with any guard; a bundle records the one it was gated with."""


class CheckpointError(StackError):
    """A checkpoint is missing, unreadable, or does not fit the pipeline."""


def save_model_checkpoint(path: str | Path, pipeline: Pipeline, state_dict: dict, extra: dict | None = None) -> Path:
    """Write the network's `state_dict` with its resolved pipeline to `path`, atomically."""
    import torch

    from stack.config import pipeline_hash, pipeline_to_yaml
    from stack.lineage import checkpoint_lineage

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "schema_version": SCHEMA_VERSION,
        "pipeline_yaml": pipeline_to_yaml(pipeline), "pipeline_hash": pipeline_hash(pipeline),
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()}, "extra": dict(extra or {}),
        **checkpoint_lineage(pipeline),  # the dataset it trained on; the MLflow run when tracked (stack.lineage)
    }
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        torch.save(payload, temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return path


SAFETENSORS_KEY = "stack"
"""The safetensors metadata key holding the plain format's keys other than the weights, as JSON."""


def save_safetensors_checkpoint(path: str | Path, pipeline_yaml: str, pipeline_hash: str, state_dict: dict,
                                extra: dict | None = None, lineage: dict | None = None) -> Path:
    """Write a network as one safetensors file (weights) whose metadata header carries its resolved pipeline YAML,
    hash, extras and lineage: `load_model_checkpoint` reads it back as the plain format, with no pickle."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "pipeline_yaml": pipeline_yaml,
              "pipeline_hash": pipeline_hash, "extra": dict(extra or {}), **(lineage or {})}
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        save_file(tensors, temp, metadata={SAFETENSORS_KEY: json.dumps(header, sort_keys=True)})
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return path


def _read_safetensors(path: Path) -> dict:
    """The plain format's dict from a `save_safetensors_checkpoint` file, or a CheckpointError saying what it is."""
    from safetensors import safe_open

    from stack.errors import StackError
    from stack.user_json import parse_json

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = (handle.metadata() or {}).get(SAFETENSORS_KEY)
            state_dict = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises, it is not a safetensors file
        raise CheckpointError(f"{str(path)!r} is not a safetensors file that can be read ({type(exc).__name__}: "
                              f"{str(exc)[:200]}). Give the file `stack reference pin` or `stack train` wrote.") from None
    try:
        raw = parse_json(header, str(path), "", "") if isinstance(header, str) else None
    except StackError:  # the message below says what a stack network holds
        raw = None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(path)!r} holds weights but no stack pipeline (its safetensors metadata has no "
                              f"valid {SAFETENSORS_KEY!r} entry): it is not a network `stack` wrote. A backbone's "
                              f"weights go to model.backbone_checkpoint instead.")
    return {**raw, "state_dict": state_dict}


def load_model_checkpoint(path: str | Path) -> tuple[Pipeline, dict, dict]:
    """(pipeline, state_dict, meta) from a plain or Lightning checkpoint, or a `CheckpointError`.

    `meta` holds `pipeline_hash`, `format` ("stack-model" or "lightning"), `extra`
    (the plain format's extras, or Lightning's epoch/global_step), and the lineage records
    `dataset` and `tracking` (`stack.lineage`; None in checkpoints written before them).
    """
    from stack.config import pipeline_from_yaml

    path = Path(path)
    raw = _read(path)
    text, stored_hash = _pipeline_text(raw, path)
    _check_schema_version(text, path)
    pipeline = pipeline_from_yaml(text, source=f"the pipeline stored in checkpoint {str(path)!r}")
    if raw.get("format") == FORMAT:
        state_dict, kind, extra = raw["state_dict"], FORMAT, raw.get("extra", {})
    else:
        state_dict, kind = _strip_prefix(raw["state_dict"]), "lightning"
        extra = {k: raw[k] for k in ("epoch", "global_step") if k in raw}
    _check_tensors(state_dict, path)
    return pipeline, state_dict, {"pipeline_hash": stored_hash, "format": kind, "extra": extra, **_lineage(raw)}


def read_lineage(path: str | Path) -> dict:
    """The `dataset` and `tracking` records of the checkpoint at `path` (None each where absent or unreadable),
    without reading its weights (memory-mapped, weights-only)."""
    import torch

    try:
        raw = _read_safetensors(Path(path)) if Path(path).suffix == ".safetensors" else \
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - the caller already loaded (and vouched for) this file; lineage is extra
        raw = {}
    return _lineage(raw if isinstance(raw, dict) else {})


def load_for_deploy(path: str | Path, files: list, overrides: list) -> tuple[Pipeline, dict, dict]:
    """The checkpoint with the pipeline a deploy command runs under.

    With no config files, the checkpoint's own pipeline is used (with `overrides`
    applied to it); with files, that pipeline must describe the same network.
    """
    stored, state_dict, meta = load_model_checkpoint(path)
    return pipeline_for_checkpoint(stored, path, files, overrides), state_dict, meta


def pipeline_for_checkpoint(stored: Pipeline, path: str | Path, files: list, overrides: list) -> Pipeline:
    """`files` + `overrides`, or with no files the checkpoint's own pipeline + `overrides`; either way
    refused (CheckpointError) when it describes another network than the checkpoint's."""
    from stack.config import load_pipeline, pipeline_to_yaml

    if files:
        pipeline = load_pipeline(files, overrides)
    else:
        with tempfile.TemporaryDirectory() as folder:
            copy = Path(folder) / "checkpoint_pipeline.yaml"
            copy.write_text(pipeline_to_yaml(stored))
            pipeline = load_pipeline([copy], overrides)
    check_same_network(stored, pipeline, path)
    return pipeline


def check_weights_fit(pipeline: Pipeline, state_dict: dict, path: str | Path) -> None:
    """Refuse weights that do not fit the network `pipeline` describes (names and shapes), before any work:
    `load_state_dict` would stop later with a traceback listing hundreds of keys."""
    from stack.models import build_model

    expected = {k: tuple(v.shape) for k, v in build_model(pipeline).state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state_dict.items()}
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    shapes = [f"{k}: {found[k]} vs {expected[k]}" for k in sorted(set(found) & set(expected)) if found[k] != expected[k]]
    if missing or unexpected or shapes:
        parts = [f"{len(missing)} missing (e.g. {', '.join(missing[:3])})" if missing else "",
                 f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})" if unexpected else "",
                 f"{len(shapes)} of another shape (checkpoint vs network: {'; '.join(shapes[:3])})" if shapes else ""]
        raise CheckpointError(
            f"the weights in {str(path)!r} do not fit the network its pipeline describes: "
            f"{', '.join(p for p in parts if p)}. It was written by another version of stack.models or edited; "
            f"use the model.pt that `stack train` wrote with this version.")


def load_network(path: str | Path, needs_planner: bool = False):
    """(stored pipeline, network in eval mode with the checkpoint's weights) of a model.pt, after the checks
    every reader makes (safe loading, weights that fit); `needs_planner` refuses weights without a planning
    head (a network that must drive)."""
    from stack.models import build_model

    stored, state_dict, _ = load_model_checkpoint(path)
    if needs_planner:
        check_has_planner(state_dict, path)
    check_weights_fit(stored, state_dict, path)
    net = build_model(stored)
    net.load_state_dict(state_dict)
    return stored, net.eval()


def check_has_planner(state_dict: dict, path: str | Path) -> None:
    """A checkpoint whose weights hold no planning head cannot drive: say so before any episode runs."""
    if not any(key.startswith("planning_head.") for key in state_dict):
        raise CheckpointError(f"checkpoint {path} has no planning head (no planning_head.* weights): it cannot "
                              f"drive. Drive a checkpoint of the full multi-task network that `stack train` writes "
                              f"(runs/<preset>/train/model.pt).")


def check_same_network(checkpoint: Pipeline, given: Pipeline, path: str | Path) -> None:
    """Raise when `given` describes another network than the one `checkpoint` was trained as."""
    differences = model_differences(checkpoint, given)
    if differences:
        shown = "\n".join(f"  {key}: checkpoint has {a!r}, the pipeline given has {b!r}" for key, a, b in differences[:12])
        more = f"\n  ... and {len(differences) - 12} more" if len(differences) > 12 else ""
        raise CheckpointError(
            f"checkpoint {str(path)!r} was trained with another pipeline than the one given "
            f"(sections {', '.join(MODEL_SECTIONS)} must agree):\n{shown}{more}\n"
            f"Pass the config files it was trained with (-c ...), or none to use the pipeline stored in the checkpoint."
        )


def model_differences(a: Pipeline, b: Pipeline) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every model-relevant key that differs."""
    import dataclasses

    found = []
    for section in MODEL_SECTIONS:
        left, right = _section(dataclasses.asdict(a), section), _section(dataclasses.asdict(b), section)
        found.extend(_diff(left, right, section))
    return found


# ------------------------------------------------------------------- helpers


WHAT_TRAIN_WROTE = ("Give what `stack train` wrote under train.out_dir: model.pt (the weights when training ends) "
                    "or a checkpoints/step-*.ckpt folder (any resumable checkpoint).")


def _read(path: Path) -> dict:
    import pickle

    import torch

    if path.is_dir() and (path / "meta.pt").is_file():  # stack.checkpoint.sharded.META
        return _read_checkpoint_folder(path)
    if not path.is_file():
        raise CheckpointError(missing_file_message("checkpoint", path, WHAT_TRAIN_WROTE))
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" not in str(exc):  # not a pickle that names a callable: garbage or truncated
            raise CheckpointError(f"{str(path)!r} is not a checkpoint torch can read ({_refusal_reason(exc)}). "
                                  f"Give the file that `stack train` wrote.") from None
        raise CheckpointError(
            f"refused to load {str(path)!r}: it holds objects other than tensors, numbers, strings and containers "
            f"({_refusal_reason(exc)}). Unpickling them could run code from "
            f"the file, so the stack loads checkpoints weights-only and nothing else. Give the model.pt or .ckpt "
            f"that `stack train` wrote (they hold tensors and plain values only)."
        ) from None
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means "not a checkpoint"
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint torch can read ({type(exc).__name__}: {str(exc)[:200]}). "
            f"Give the file that `stack train` wrote."
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("state_dict"), dict):
        found = f"a dict with keys {sorted(raw)[:8]}" if isinstance(raw, dict) else f"a {type(raw).__name__}"
        raise CheckpointError(
            f"{str(path)!r} is not a model checkpoint: expected a dict with a 'state_dict', found {found}. "
            f"Give the file that `stack train` wrote."
        )
    return raw


def _read_checkpoint_folder(path: Path) -> dict:
    """A resumable checkpoint folder (`stack.checkpoint.sharded`: meta.pt plus DCP shards), every tensor whole on the
    CPU, read without unpickling code: a run stopped before model.pt (a time limit, a crash) is still evaluated,
    exported and deployed from its newest checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    from stack.checkpoint.sharded import first_line, load_sharded_checkpoint

    try:
        return load_sharded_checkpoint(path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure to read is the same answer
        raise CheckpointError(f"checkpoint folder {str(path)!r} cannot be read ({first_line(exc)[:300]}): it is "
                              f"truncated, corrupt or not written by `stack train`. Give another checkpoint of its "
                              f"folder, or model.pt.") from None


WEIGHTS_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")
"""Where training scripts nest a network's weights inside a saved dict (timm's order: EMA weights first)."""


def read_weights_file(path: str | Path, key: str, what: str) -> dict:
    """The tensors of a weights file the user names under `key` (`what`: what it should hold), read as safetensors
    or `torch.load(weights_only=True)` and nothing else: a pickle that names a callable is refused, as are text
    and other non-weight files, with one line saying what was expected (never a traceback from the reader)."""
    import torch

    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            raw = load_file(str(path), device="cpu")
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises, the file is not weights it can read
        raise CheckpointError(
            f"{key} {str(path)!r} is not a weights file that can be read without running code from it "
            f"({_refusal_reason(exc)}). Expected {what}: a state dict saved with torch.save(model.state_dict()) "
            f"(.pth/.pt) or a .safetensors file.") from None
    nested = next((raw[k] for k in WEIGHTS_KEYS if isinstance(raw, dict) and isinstance(raw.get(k), dict)), raw)
    tensors = isinstance(nested, dict) and nested and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in nested.items())
    if not tensors:
        found = f"a dict with keys {sorted(map(str, nested))[:6]}" if isinstance(nested, dict) else \
            f"a {type(nested).__name__}"
        raise CheckpointError(f"{key} {str(path)!r} holds no state dict: expected {what} (names to tensors), found "
                              f"{found}. Save the weights with torch.save(model.state_dict()).")
    return {k.removeprefix("module."): v for k, v in nested.items()}


def _lineage(raw: dict) -> dict:
    """The checkpoint's `dataset` and `tracking` records (stack.lineage), None where it has none (older files)."""
    from stack.lineage import DATASET_KEY, TRACKING_KEY

    return {key: raw[key] if isinstance(raw.get(key), dict) else None for key in (DATASET_KEY, TRACKING_KEY)}


def _refusal_reason(exc: Exception) -> str:
    """The line of torch's weights-only error that names the object (e.g. 'unsupported GLOBAL posix.system')."""
    lines = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line]
    lines = [line.removeprefix("Weights only load failed. ") for line in lines]
    return (lines[0] if lines else str(exc).strip().splitlines()[-1])[:200].rstrip(".")


def _pipeline_text(raw: dict, path: Path) -> tuple[str, str | None]:
    hyper = raw.get("hyper_parameters") if isinstance(raw.get("hyper_parameters"), dict) else {}
    for source in (raw, hyper):
        if isinstance(source.get("pipeline_yaml"), str):
            return source["pipeline_yaml"], source.get("pipeline_hash")
    raise CheckpointError(
        f"checkpoint {str(path)!r} carries no pipeline: expected the resolved pipeline YAML under "
        f"'pipeline_yaml' (top level or hyper_parameters), found keys {sorted(raw)[:10]}. "
        f"Checkpoints written by `stack train` (or save_model_checkpoint) carry it; retrain or re-save with it."
    )


def _check_tensors(state_dict: dict, path: Path) -> None:
    import torch

    odd = [k for k, v in state_dict.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if odd:
        value = state_dict[odd[0]]
        raise CheckpointError(f"{str(path)!r} is not a model checkpoint: its state_dict maps {odd[0]!r} to "
                              f"{type(value).__name__} {str(value)[:40]!r}, not a tensor. Give the file that "
                              "`stack train` wrote.")


def _check_schema_version(text: str, path: Path) -> None:
    from stack.config import YAML_ERRORS, parse_yaml_value

    try:
        parsed = parse_yaml_value(text)
    except YAML_ERRORS:
        return  # pipeline_from_yaml reports the syntax error with its location
    version = parsed.get("schema_version", SCHEMA_VERSION) if isinstance(parsed, dict) else SCHEMA_VERSION
    if version not in READABLE_SCHEMAS:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written with pipeline schema {version}; this stack reads schemas "
            f"{', '.join(map(str, READABLE_SCHEMAS))} (older ones moved to today's keys). Export it with the stack version that trained it, or retrain."
        )


def _strip_prefix(state_dict: dict) -> dict:
    if any(k.startswith(MODEL_PREFIX) for k in state_dict):
        return {k[len(MODEL_PREFIX):]: v for k, v in state_dict.items() if k.startswith(MODEL_PREFIX)}
    return dict(state_dict)


def _section(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _diff(left: Any, right: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    if isinstance(left, dict) and isinstance(right, dict):
        found = []
        for key in sorted(set(left) | set(right)):
            found.extend(_diff(left.get(key), right.get(key), f"{prefix}.{key}"))
        return found
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        return [d for i, (a, b) in enumerate(zip(left, right)) for d in _diff(a, b, f"{prefix}.{i}")]
    return [] if left == right else [(prefix, left, right)]
