"""`stack reference`: the pinned reference network (`stack.deploy.reference`, `models/reference/tiny-drive/`).

    stack reference replay                                   # today's code on the pinned frames: exit 0 / 1
    stack reference pin CHECKPOINT --eval METRICS --drive DRIVE_JSON   # pin a network with its card
    stack reference reproduce --eval METRICS --drive DRIVE_JSON [--record]  # a new training against the card

`pin` takes the checkpoint `make drive-recipe` trained, its `stack eval` metrics.json and the drive.json of its
held-out drive (`stack drive CHECKPOINT`, which drives it alone beside it); how it was trained (commit, wall time)
comes from its MLflow run. `replay` exits 1 when an output or plan moved beyond the replay's tolerance: an intended
change re-pins with `make pin-reference`. `reproduce` prints PASS or FAIL (exit 0 / 1) and with `--record` adds the
verdict to the card. Exit 2 for bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stack.errors import StackError

ACTIONS = ("replay", "pin", "reproduce")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eval", metavar="METRICS", help="stack eval's metrics.json of the network (pin, reproduce)")
    parser.add_argument("--drive", metavar="DRIVE_JSON", help="drive.json of its held-out drive (pin, reproduce)")
    parser.add_argument("--folder", metavar="DIR", help="the reference folder (default models/reference/tiny-drive)")
    parser.add_argument("--record", action="store_true", help="reproduce: add the verdict to the card")
    parser.usage = ("stack reference replay [--folder DIR]  |  stack reference pin CHECKPOINT --eval METRICS --drive "
                    "DRIVE_JSON  |  stack reference reproduce --eval METRICS --drive DRIVE_JSON [--record]")


def run(args: argparse.Namespace) -> int:
    from stack.deploy import reference

    words = [word for word in args.overrides if "=" not in word]
    if not words or words[0] not in ACTIONS or args.overrides != words:
        raise StackError(f"stack reference takes an action ({', '.join(ACTIONS)}) and no config keys; got "
                         f"{' '.join(args.overrides) or 'nothing'}")
    action, rest = words[0], words[1:]
    folder = Path(args.folder) if args.folder else reference.REFERENCE_DIR
    if action == "replay":
        _no_more(rest, action)
        problems = reference.replay(folder)
        for line in problems:
            print(f"  {line}")
        print(f"stack reference replay: {'FAIL' if problems else 'PASS'} ({folder})")
        return 1 if problems else 0
    files = _files(args, action)
    if action == "pin":
        if len(rest) != 1:
            raise StackError("stack reference pin takes one CHECKPOINT (the model.pt `make drive-recipe` trained)")
        reference.pin(rest[0], folder, *files, trained_record(rest[0]))
        return 0
    _no_more(rest, action)
    verdict = reference.reproduce(folder, *files)
    print("\n".join(verdict["lines"]))
    print(f"stack reference reproduce: {'PASS' if verdict['passed'] else 'FAIL'} against {folder / reference.CARD_MD}")
    if args.record:
        reference.record_reproduction(folder, verdict, machine_record())
    return 0 if verdict["passed"] else 1


def _no_more(rest: list[str], action: str) -> None:
    if rest:
        raise StackError(f"stack reference {action} takes no paths besides its options; got {' '.join(rest)}")


def _files(args, action: str) -> tuple[Path, Path]:
    if not args.eval or not args.drive:
        raise StackError(f"stack reference {action} needs --eval (stack eval's metrics.json) and --drive (the "
                         f"drive.json of the network's held-out drive)")
    for path in (args.eval, args.drive):
        if not Path(path).is_file():
            raise StackError(f"{path}: no such file (expected a metrics.json or drive.json)")
    return Path(args.eval), Path(args.drive)


def machine_record() -> dict:
    """Where and when: today's date, this CPU, the code's commit."""
    import datetime

    from stack.benchrecord.machine import cpu_model
    from stack.lineage import git_commit

    commit, dirty = git_commit()
    return {"date": datetime.date.today().isoformat(), "cpu": describe_cpu(cpu_model()),
            "commit": commit[:12] + (" (dirty)" if dirty == "true" else "")}


def describe_cpu(model: str) -> str:
    """The CPU model with the widest vector and matrix extensions it has (AVX2 / AVX-512 BF16 / AMX): what
    decides its float kernels and its training precision."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration, IndexError):
        return model
    kind = ("AMX" if "amx_tile" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else
            "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE")
    return f"{model} ({kind})"


def trained_record(checkpoint: str) -> dict:
    """How the checkpoint was trained, from its MLflow run (commit, host, precision, steps, wall time) where it has
    one; the command is `make drive-recipe`'s."""
    from stack.checkpoint.model_file import read_lineage

    found = {"command": "make drive-recipe (stack train -c configs/pipeline.yaml -c configs/presets/tiny.yaml "
                        "-c configs/presets/tiny-drive.yaml)", **machine_record()}
    run = (read_lineage(checkpoint) or {}).get("tracking") or {}
    try:
        import mlflow

        info = mlflow.MlflowClient(tracking_uri=run["uri"]).get_run(run["run_id"])
    except Exception:  # noqa: BLE001 - no run to read: the card says what is known
        return found
    tags, end = info.data.tags, info.info.end_time or info.info.start_time
    found.update(commit=tags.get("stack.git_commit", found["commit"])[:12], host=tags.get("stack.host", "?"),
                 precision=tags.get("stack.precision", "?"), steps=tags.get("stack.steps", "?"),
                 wall_s=(end - info.info.start_time) / 1000.0)  # cpu: this machine's, where `make pin-reference`
    return found                                                # runs after `make drive-recipe`
    return found
