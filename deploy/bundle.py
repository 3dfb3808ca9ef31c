"""The deploy bundle on disk: built aside, swapped in whole, and vouched for file by file.

A bundle is what goes to the car, so it must never be half old and half new: a re-deploy
killed after writing the new `model.onnx` but before its gate ran would otherwise leave a
folder whose `gate.json` says PASS about a network it never scored. So

- `stage(folder)` gives a fresh staging folder beside the bundle (`.NAME.staging-PID`);
  every file of the new bundle is written there, and staging folders left by killed runs
  (their PID gone) are removed;
- `swap_in(staging, folder)` replaces the old bundle by the new one in one step: Linux's
  `renameat2(RENAME_EXCHANGE)` swaps the two directory entries atomically (rename(2)
  cannot replace a non-empty directory); where the call or the file system lacks it, two
  renames leave at most a moment with no bundle at all, never a mixed one;
- `gate.json` lists the sha256 of every other file in the bundle (`files`) and of the
  checkpoint it was built from, and `verify_bundle` refuses a bundle whose files differ:
  one changed, missing, or added after the gate ran. The one exception is `device/`, where
  `build_engine.sh` leaves what it makes on the car (engine, timing cache, trtexec log):
  outputs of the gated files, not inputs to the gate.

gate.json itself is covered too: it carries `gate_sha256`, the sha256 of its own content (canonical JSON,
without that key), and `verify_bundle` also refuses a symbolic link anywhere in the bundle, a `shipped`
model that is not one of the bundle's vouched model files, and verdicts that do not follow from the
figures and budgets gate.json records (`stack.deploy.verdicts`). A sha256 anyone can recompute is not a
signature: it catches an edited or damaged gate.json, while the recomputed verdicts catch an edit that
also rewrote the digest but left a verdict disagreeing with its figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from stack.durable import exchange
from stack.errors import StackError
from stack.failpoints import fail_point
from stack.safe_values import escaped
from stack.user_json import read_json

GATE_FILE = "gate.json"
GATE_DIGEST = "gate_sha256"
"""gate.json's key holding the sha256 of the rest of gate.json (`gate_digest`)."""
MODEL_FILES = ("model.int8.onnx", "model.onnx")
"""The model files a bundle may ship (gate.json's `shipped`)."""
DEVICE_FOLDER = "device"
"""Where the on-device build writes; not covered by the checksums."""


class BundleMismatch(StackError):
    """A bundle's files are not the files its gate.json vouches for."""


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def bundle_files(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file in `folder` except gate.json itself and the device/ outputs."""
    return {name: sha256_file(folder / name) for name in bundle_names(folder)}


def bundle_names(folder: Path) -> list[str]:
    """Relative paths of the files `bundle_files` hashes, without reading any of them."""
    names = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and relative.as_posix() != GATE_FILE and relative.parts[0] != DEVICE_FOLDER:
            names.append(relative.as_posix())
    return names


def check_replaceable(folder: Path) -> None:
    """Refuse to replace a folder that holds files but is not a bundle (no gate.json): they are the user's."""
    if folder.exists() and not folder.is_dir():
        raise StackError(f"the bundle folder {folder} is a file; expected a folder (or nothing) there. "
                         f"Move the file, or choose another export.out_dir.")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / GATE_FILE).is_file():
        raise StackError(f"{folder} holds files but is not a deploy bundle (no {GATE_FILE}); deploy replaces the "
                         f"whole folder, so it will not write there. Choose another export.out_dir or move the files.")


STAGING = re.compile(r"\..+\.staging-\d+")
"""The name of a staging folder (`.NAME.staging-PID`)."""


def is_deploy_folder(path: Path) -> bool:
    """A bundle (a folder holding gate.json), or one being staged or left by a killed deploy (`stage`)."""
    return path.is_dir() and ((path / GATE_FILE).is_file() or bool(STAGING.fullmatch(path.name)))


def stage(folder: Path) -> Path:
    """A new, empty staging folder beside `folder`, after removing those left by runs that no longer exist."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.staging-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    staging = folder.parent / f".{folder.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a folder with our own PID is from an earlier call in this process: stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def vouch(staging: Path, result: dict, checkpoint: str = "") -> dict:
    """Record the sha256 of every file of the staged bundle (and of the checkpoint) in `result`."""
    result["files"] = bundle_files(staging)
    if checkpoint and Path(checkpoint).is_file():
        result["checkpoint_sha256"] = sha256_file(checkpoint)
    return result


def swap_in(staging: Path, folder: Path) -> None:
    """Make `staging` the bundle at `folder` in one step; the old bundle, if any, is removed afterwards."""
    fail_point("deploy-before-swap")
    try:
        if not folder.exists():
            os.rename(staging, folder)
            return
        if exchange(staging, folder):
            fail_point("deploy-after-swap")
            shutil.rmtree(staging, ignore_errors=True)  # now holds the old bundle
            return
        old = folder.parent / f".{folder.name}.staging-old-{os.getpid()}"
        os.rename(folder, old)
        os.rename(staging, folder)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:  # e.g. another deploy wrote the same bundle at the same moment
        raise StackError(f"could not put the new bundle in place at {folder} ({exc.strerror}); the complete new "
                         f"bundle is in {staging}. Is another `stack deploy` writing the same target? Run it again.")


def read_gate(folder: str | Path) -> dict:
    """gate.json of the bundle at `folder`, or a StackError that says what is wrong."""
    folder = Path(folder)
    path = folder / GATE_FILE
    if not folder.is_dir():
        raise StackError(f"{folder} is not a deploy bundle: expected a folder written by `stack deploy`, "
                         f"found {'a file' if folder.exists() else 'nothing'}.")
    if not path.is_file():
        raise StackError(f"{folder} is not a deploy bundle: it has no {GATE_FILE}. Run `stack deploy` to build one.")
    try:
        gate = read_json(path, f"the {GATE_FILE} `stack deploy` writes", "The bundle cannot be trusted: deploy again.",
                         infinity=True)
    except StackError as refused:
        raise BundleMismatch(str(refused)) from None
    if not isinstance(gate.get("files"), dict):
        raise BundleMismatch(f"{path} lists no file checksums (expected a 'files' object of sha256 sums): it was "
                             f"written by an older stack or edited. Deploy again to get a bundle that can be verified.")
    malformed = [name for name, digest in gate["files"].items()
                 if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest))]
    if malformed or not isinstance(gate.get("passed"), bool):
        what = f"checksums that are not sha256 hex digests ({malformed[:3]})" if malformed else \
            f"a verdict 'passed' that is not true or false ({gate.get('passed')!r})"
        raise BundleMismatch(f"{path} has {what}: it was edited. Deploy again.")
    return gate


def gate_digest(gate: dict) -> str:
    """sha256 of gate.json's content without its own digest, in one canonical JSON form (sorted keys)."""
    body = {key: value for key, value in gate.items() if key != GATE_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(result: dict) -> str:
    """gate.json's text for `result`, carrying its own sha256 (`GATE_DIGEST`), as `verify_bundle` reads it."""
    body = json.loads(json.dumps(result, default=float))  # the form a reader gets back (numpy floats -> floats)
    body[GATE_DIGEST] = gate_digest(body)
    return json.dumps(body, indent=2) + "\n"


def verify_bundle(folder: str | Path) -> dict:
    """gate.json of the bundle at `folder` after checking it and every file it vouches for: its own sha256, no
    symbolic links, the files, the shipped model, and each verdict against its figures."""
    folder = Path(folder)
    gate = read_gate(folder)
    if gate.get(GATE_DIGEST) != gate_digest(gate):
        raise BundleMismatch(f"{folder / GATE_FILE} does not match its own sha256 ({GATE_DIGEST}): it was edited, "
                             "damaged or written by an older stack. Its verdict cannot be trusted; deploy again.")
    _check_files(folder, gate)
    _check_verdicts(folder, gate)
    _check_post_processing(folder, gate)
    return gate


def _check_files(folder: Path, gate: dict) -> None:
    """Every file is the one gate.json vouches for, and none is a link (it could point anywhere: at a file outside
    the bundle, or at /dev/zero, whose sha256 never ends), which is refused before any file is read."""
    links = [path.relative_to(folder).as_posix() for path in _links(folder)]
    if links:
        raise BundleMismatch(f"bundle {folder} holds symbolic links ({escaped(', '.join(links[:5]))}); a bundle holds only "
                             "the files `stack deploy` wrote. Its gate verdict does not cover them; deploy again.")
    names, vouched = set(bundle_names(folder)), gate["files"]
    problems = [f"{escaped(name)}: missing" for name in sorted(set(vouched) - names)]
    problems += [f"{escaped(name)}: not part of the gated bundle" for name in sorted(names - set(vouched))]
    if not problems:  # names first: a file gate.json does not list is refused unread (it may be huge)
        found = {name: sha256_file(folder / name) for name in sorted(names)}
        problems = [f"{escaped(name)}: changed since the gate ran (sha256 {found[name][:12]}…, vouched "
                    f"{vouched[name][:12]}…)" for name in sorted(names) if found[name] != vouched[name]]
    if problems:
        raise BundleMismatch(f"bundle {folder} does not match its {GATE_FILE}:\n  " + "\n  ".join(problems)
                             + "\nIts gate verdict does not cover these files; deploy again to rebuild it.")


def _links(folder: Path) -> list[Path]:
    """Symbolic links anywhere in the bundle except the device/ outputs (never followed while looking)."""
    found = []
    for top, folders, files in os.walk(folder):
        here = Path(top)
        found += [here / name for name in folders + files if (here / name).is_symlink()]
        if here == folder:
            folders[:] = [name for name in folders if name != DEVICE_FOLDER]
    return sorted(found)


def _check_verdicts(folder: Path, gate: dict) -> None:
    """`shipped` names a vouched model file of the bundle, and every verdict follows from its figures."""
    from stack.deploy.verdicts import verdict_problems

    shipped = gate.get("shipped")
    name = shipped.get("file") if isinstance(shipped, dict) else None
    if name not in MODEL_FILES or name not in gate["files"]:
        raise BundleMismatch(f"{folder / GATE_FILE} ships {escaped(repr(name))}; expected one of the bundle's own "
                             f"model files {list(MODEL_FILES)} that gate.json vouches for. Deploy again.")
    problems = verdict_problems(gate)
    if problems:
        raise BundleMismatch(f"{folder / GATE_FILE} contradicts its own figures:\n  " + "\n  ".join(problems)
                             + "\nIts verdict cannot be trusted; deploy again.")


def _check_post_processing(folder: Path, gate: dict) -> None:
    """The post-processing gate.json records (`post_processing`) is valid, is what the bundle's own pipeline.yaml
    says, and is what its closed-loop gate drove with: an edited setting, even resealed, fails here. Settings of a
    rule removed since, recorded off, are read as today's (`stack.pipeline.migrate_guard_settings`)."""
    from stack.config import pipeline_from_yaml
    from stack.models.post_processing import guard_from_settings, post_processing_record
    from stack.pipeline import migrate_guard_settings

    recorded = gate.get("post_processing")
    if recorded is None:
        return  # a network without a planner, or a bundle older than the record: DeployedNetwork.plan refuses it
    problems = []
    try:
        guard_from_settings(recorded.get("guard") if isinstance(recorded, dict) else None)
        recorded = {**recorded, "guard": migrate_guard_settings(recorded["guard"])}
    except StackError as exc:
        problems.append(str(exc))
    pipeline_file = folder / "pipeline.yaml"
    if not problems and pipeline_file.is_file():
        try:
            written = post_processing_record(pipeline_from_yaml(pipeline_file.read_text(), source=str(pipeline_file)))
        except StackError as exc:
            problems.append(f"its pipeline.yaml cannot be read ({exc})")
        else:
            problems += [f"post_processing.{key} says {recorded.get(key)!r} but pipeline.yaml says {value!r}"
                         for key, value in written.items() if recorded.get(key) != value]
    drove = (gate.get("closed_loop") or {}).get("guard") if isinstance(gate.get("closed_loop"), dict) else None
    try:
        drove = migrate_guard_settings(drove, "the closed-loop gate's guard settings")
    except StackError as exc:
        problems.append(str(exc))
    if not problems and drove is not None and drove != recorded.get("guard"):
        problems.append(f"post_processing.guard says {recorded.get('guard')!r} but the closed-loop gate drove with "
                        f"{drove!r}")
    if problems:
        raise BundleMismatch(f"{folder / GATE_FILE}: the plan's post-processing it ships is not the one it was gated "
                             "with:\n  " + "\n  ".join(problems) + "\nA car would not drive the way the closed-loop "
                             "gate saw it drive; deploy again (a new setting is a new deploy).")
