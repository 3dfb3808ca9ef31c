"""`stack drive CHECKPOINT|BUNDLE ...`: the trained or the deployed network drives the rendered world in closed loop.

Each source is a checkpoint (`stack train`'s model.pt, driven in PyTorch) or a deploy bundle folder
(driven on ONNX Runtime: the model it ships, or `--policy int8` / `fp32`); several may be given and
drive side by side, with the baselines of `drive.baselines` (the privileged expert, constant velocity,
the ego-status rollout). Every policy drives the same `drive.episodes` held-out episodes of the
`drive.scenarios` families over `drive.seeds`; the report (drive.md, drive.json, drive.png) and MP4
clips of each policy's worst episodes (`drive.clips`) and of its best in every family (`drive.best_clips`)
go to `drive.out_dir`.

`--scenarios a,b` and `--episodes N` are shorthands for drive.scenarios=[a,b] and drive.episodes=N.
The bar: a network must beat every blind policy driven beside it in driving score and in PDMS, the paired
bootstrap interval (90%, whole episodes resampled) of each gain above zero (`stack.metrics.driving
.closed_loop_bar`); drive.md shows it. Exit 0 when the episodes ran and every network cleared the bar (or
none was judged), 1 when a network fell below it (as `stack eval` for a head below its bar); 2 for bad input
(an unknown scenario, a checkpoint without a planner, a bundle built for another network or camera rig).

`stack drive --compare BEFORE AFTER` drives nothing: it compares two finished drives of the same episodes (a
setting changed between them), episode by episode, with a paired bootstrap interval of each gain
(`stack.sim.drive_compare`). Exit 0 when compared, 2 when the reports are missing, unreadable or of other worlds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stack.errors import StackError

POLICY_CHOICES = ("network", "int8", "fp32", "alone", "expert", "constant_velocity", "ego_rollout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", metavar="LIST",
                        help="comma-separated policies to drive: network (each source as built: a checkpoint in "
                             "PyTorch, a bundle's shipped model), int8 / fp32 (a bundle's model of that precision), "
                             "alone (the first guarded source without its plan guard, beside it: which part drives), "
                             "and baselines expert, constant_velocity, ego_rollout. Default: network + alone + "
                             "drive.baselines")
    parser.add_argument("--scenarios", metavar="LIST", help="shorthand for drive.scenarios=[...] (comma-separated)")
    parser.add_argument("--episodes", metavar="N", help="shorthand for drive.episodes=N")
    parser.add_argument("--experiment-guard", action="store_true",
                        help="drive bundles with the guard section of the pipeline given (-c files, guard.* keys) "
                             "instead of the plan guard they ship: an experiment, and drive.md says the bundle was "
                             "not driven as shipped (without it a bundle drives as it ships, and other guard "
                             "settings are refused)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="drive nothing: compare two drives' reports (folders or drive.json) of the same "
                             "episodes, episode by episode, with a paired bootstrap interval of each gain")
    parser.usage = ("stack drive CHECKPOINT|BUNDLE [CHECKPOINT|BUNDLE ...] [--policy LIST] [options] [key=value ...]"
                    "  |  stack drive --compare BEFORE AFTER")


def run(args: argparse.Namespace) -> int:
    from stack.sim.drive import drive

    if args.compare:
        return _compare(args)
    sources = [word for word in args.overrides if "=" not in word]
    args.overrides = [word for word in args.overrides if "=" in word] + _shorthands(args)
    if not sources:
        raise StackError("stack drive needs a CHECKPOINT (stack train's model.pt) or a deploy BUNDLE folder "
                         "(e.g. runs/tiny/export/cpu); several may be given to drive side by side.")
    pipeline = _pipeline(sources, args)
    policies = _policies(sources, _choices(args.policy, pipeline), pipeline, args.experiment_guard)
    result = drive(pipeline, policies, sources={p.name: p.source for p in policies if p.source})
    print((Path(pipeline.drive.out_dir) / "drive.md").read_text())
    failed = [name for name, bar in result["bar"].items() if bar["passed"] is False and not bar.get("information")]
    if failed:
        print(f"stack drive: below the closed-loop bar (does not beat the blind policies): {', '.join(failed)}")
    return 0 if result["rows"] and not failed else 1


def _compare(args: argparse.Namespace) -> int:
    """`--compare BEFORE AFTER`: print the paired comparison of two drives (`stack.sim.drive_compare`)."""
    from stack.sim.drive_compare import compare_drives, compare_markdown, read_drive

    extra = args.overrides + [flag for flag, value in (("--policy", args.policy), ("--scenarios", args.scenarios),
                                                        ("--episodes", args.episodes),
                                                        ("--experiment-guard", args.experiment_guard)) if value]
    if extra:
        raise StackError(f"stack drive --compare reads two finished drives and drives nothing; it takes no sources, "
                         f"keys or driving options (got {' '.join(extra)}): drive first, then compare the reports")
    before, after = (read_drive(path) for path in args.compare)
    print(compare_markdown(before, after, compare_drives(before, after)), end="")
    return 0


def _shorthands(args) -> list[str]:
    out = []
    if args.scenarios:
        names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        out.append(f"drive.scenarios=[{','.join(names)}]")
    if args.episodes:
        out.append(f"drive.episodes={args.episodes}")
    return out


def _choices(text: str | None, pipeline) -> list[str]:
    if not text:
        return ["network", "alone"] + list(pipeline.drive.baselines)
    chosen = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    unknown = [c for c in chosen if c not in POLICY_CHOICES]
    if unknown or not chosen:
        raise StackError(f"--policy {text!r}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                         f"choose from {', '.join(POLICY_CHOICES)}")
    return chosen


def _kind(source: str) -> str:
    path = Path(source)
    if path.is_dir():
        if not (path / "gate.json").is_file():
            raise StackError(f"{source} is a folder without gate.json: not a deploy bundle. Give a bundle folder "
                             f"(`stack deploy` writes {{export.out_dir}}/TARGET/) or a checkpoint file.")
        return "bundle"
    if path.is_file():
        return "checkpoint"
    raise StackError(f"{source}: no such checkpoint file or bundle folder")


def _pipeline(sources: list[str], args):
    """The pipeline to drive under: -c files + overrides, or the first source's own pipeline + overrides;
    refused when any source holds another network or was built for another camera rig."""
    from stack.checkpoint.model_file import check_has_planner, load_model_checkpoint, pipeline_for_checkpoint
    from stack.config import pipeline_to_yaml

    stored = []
    for source in sources:
        if _kind(source) == "checkpoint":
            pipeline, state_dict, meta = load_model_checkpoint(source)
            check_has_planner(state_dict, source)
            _check_trained_cameras(source, pipeline, meta.get("dataset"))
        else:
            pipeline = _bundle_pipeline(source)
        stored.append((source, pipeline))
    first_source, first = stored[0]
    pipeline = pipeline_for_checkpoint(first, first_source, args.config, args.overrides)
    for source, other in stored:
        _check_same(source, other, pipeline)
    if args.print_config:
        print(pipeline_to_yaml(pipeline), end="", flush=True)
    return pipeline


def _bundle_pipeline(source: str):
    """The pipeline a bundle folder was deployed from (its pipeline.yaml)."""
    from stack.config import pipeline_from_yaml

    file = Path(source) / "pipeline.yaml"
    if not file.is_file():
        raise StackError(f"bundle {source} has no pipeline.yaml; deploy it again with this stack")
    return pipeline_from_yaml(file.read_text(), source=f"the pipeline of bundle {source}")


def check_bundle(source: str, pipeline) -> None:
    """Refuse `source` unless it is a deploy bundle folder of `pipeline`'s network, built for the camera rig the world
    renders with, as `stack drive` refuses it (`stack bench drive BUNDLE`)."""
    if _kind(source) != "bundle":
        raise StackError(f"{source} is a checkpoint file, not a deploy bundle folder: give the folder `stack deploy` "
                         f"wrote (e.g. runs/tiny/export/ci-cpu)")
    _check_same(source, _bundle_pipeline(source), pipeline)


def bench(pipeline, args) -> int:
    """`stack bench drive [BUNDLE ...]`: the closed loop's speed (`stack.sim.bench`, where the bench lives) with the
    sources `stack drive` would drive, wired here as `stack drive` wires them (sim cannot import deploy's network
    policies): `{train.out_dir}/model.pt` when it exists, else the pipeline's network with untrained weights (same
    cost), and each deploy bundle given on ONNX Runtime."""
    import tempfile

    from stack.benchrecord import figures_of
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.deploy.network_policies import bundle_spec, checkpoint_spec
    from stack.models import build_model
    from stack.sim import bench as drive_bench

    bundles = list(getattr(args, "bundles", []))
    for bundle in bundles:
        check_bundle(bundle, pipeline)  # before minutes of driving
    deployed = [bundle_spec(f"bundle {Path(bundle).name}", bundle) for bundle in bundles]
    checkpoint = Path(pipeline.train.out_dir) / "model.pt"
    if checkpoint.is_file():
        return drive_bench.run(pipeline, checkpoint_spec("checkpoint", str(checkpoint)),
                               f"trained weights ({checkpoint})", figures_of(args), deployed)
    with tempfile.TemporaryDirectory() as folder:
        path = save_model_checkpoint(Path(folder) / "untrained.pt", pipeline, build_model(pipeline).state_dict())
        return drive_bench.run(pipeline, checkpoint_spec("checkpoint", str(path)),
                               "untrained weights (same cost as trained)", figures_of(args), deployed)


def _check_trained_cameras(source: str, stored, dataset: dict | None) -> None:
    """A network drives the world its rig renders: refuse one whose rig is not the cameras of the data it was
    trained on (its lineage record), as a checkpoint trained before `stack train` checked this can be."""
    cameras, size = (dataset or {}).get("cameras"), (dataset or {}).get("image_size")
    if not isinstance(cameras, list):
        return  # trained before lineage was recorded
    rig = stored.data.rig
    names, rig_size = [c.name for c in rig.cameras], [rig.image_height, rig.image_width]
    if cameras != names or (isinstance(size, list) and len(size) == 2 and size != rig_size):
        raise StackError(f"checkpoint {source} was trained on data recorded with cameras {cameras} at image size "
                         f"{size} (height, width), but its rig (data.rig) is {names} at {rig_size}: it would drive "
                         "with cameras it never saw. Retrain it with data.rig set to the dataset's cameras")


def _check_same(source: str, stored, pipeline) -> None:
    """A source drives only the world its network was built for: same network, same cameras."""
    from stack.checkpoint.model_file import check_same_network
    from stack.deploy.calibration import Calibration

    try:
        check_same_network(stored, pipeline, source)
    except StackError as exc:
        raise StackError(f"{source} was built by another pipeline than the one driving: {exc}") from exc
    world = Calibration.from_rig(pipeline.data.rig)
    differences = Calibration.from_rig(stored.data.rig).compare(world)
    bundle_file = Path(source) / "calibration.yaml"
    if not differences and bundle_file.is_file():  # a bundle built for one vehicle's cameras (--calibration)
        differences = Calibration.load(bundle_file).compare(world)
    if differences:
        raise StackError(f"{source} was built for another camera rig than the one the world renders with "
                         f"(data.rig): " + "; ".join(differences) + ". Drive it with its own pipeline (no -c).")


def _policies(sources: list[str], chosen: list[str], pipeline, experiment_guard: bool = False):
    """The specs to drive: each source as chosen, each fixed to the guard it drives with (a bundle's own, a
    checkpoint's pipeline's), the first guarded one followed by the same network alone (one is enough to show which
    part drives; every source of a drive is the same network); then the baselines."""
    from stack.deploy.network_policies import bundle_spec, checkpoint_spec, guard_spec, network_alone
    from stack.sim.policies import PolicySpec

    specs = []
    for source in sources:
        kind = _kind(source)
        label = Path(source).name if kind == "bundle" else "checkpoint"
        wanted = [c for c in chosen if c in ("network", "int8", "fp32")]
        if kind == "checkpoint" and [c for c in wanted if c != "network"]:
            raise StackError(f"--policy int8/fp32 choose a bundle's model; {source} is a checkpoint (use network)")
        guard, as_shipped = _bundle_guard(source, pipeline, experiment_guard) if kind == "bundle" else \
            (guard_spec(pipeline.guard), True)
        if not as_shipped:
            label += " (guard not as shipped)"
        for choice in wanted:
            if kind == "checkpoint":
                name = "checkpoint" if len(sources) == 1 else f"checkpoint {source}"
                spec = checkpoint_spec(name, source, guard=guard)
            else:
                model = None if choice == "network" else choice
                spec = bundle_spec(f"bundle {label}" + (f" {model}" if model else ""), source, model, guard=guard)
            alone = "alone" in chosen and dict(guard)["score"] and not any(s.alone_of for s in specs)
            specs += [spec] + ([network_alone(spec)] if alone else [])
    specs += [PolicySpec(c, c) for c in chosen if c in ("expert", "constant_velocity", "ego_rollout")]
    names = [s.name for s in specs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise StackError(f"two sources would drive under one name ({', '.join(clash)}): their results would mix. "
                         f"Give each source once, and bundles from differently named folders.")
    return specs


def _bundle_guard(source: str, pipeline, experiment_guard: bool) -> tuple[tuple, bool]:
    """(guard, as shipped) a bundle drives with: the one it ships; the pipeline's with --experiment-guard; refused
    when the pipeline given asks for another one without it (a bundle drives as it ships: another setting is a new
    deploy)."""
    from stack.deploy.network_policies import bundle_guard, guard_spec

    shipped, given = bundle_guard(source), guard_spec(pipeline.guard)
    if experiment_guard:
        return given, given == tuple(sorted(shipped.items()))
    differences = [f"guard.{key}: the bundle ships {value:g}, the pipeline given has {dict(given).get(key)}"
                   for key, value in sorted(shipped.items()) if dict(given).get(key) != value]
    if differences:
        raise StackError(f"bundle {source} drives with the plan guard it was gated with, and the pipeline given asks "
                         f"for another ({'; '.join(differences[:4])}). Drive it as it ships (drop those keys), deploy "
                         f"again with the new settings, or pass --experiment-guard to drive it with them as an "
                         f"experiment (drive.md says it was not driven as shipped).")
    return tuple(sorted(shipped.items())), True
