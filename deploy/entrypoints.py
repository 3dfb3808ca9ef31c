"""Entry points behind `stack export` and `stack deploy` (the CLI calls these): checkpoint in, ONNX / bundle out.

They turn a checkpoint and its pipeline into a `DeploySpec`; `stack.deploy.orchestrate` then runs the
steps and gates in order and writes the bundle. Both bake one camera calibration into the network
(`--calibration FILE`, default the pipeline's nominal `data.rig`) and, before any work, refuse
validation samples recorded with another one (`stack.deploy.calibration.check_samples`): parity,
INT8 ranges and the accuracy gate are only meaningful on frames the baked geometry belongs to.
"""

from __future__ import annotations

from pathlib import Path

from stack.deploy.bundle import is_deploy_folder
from stack.deploy.calibration import BUNDLE_FILE as CALIBRATION_FILE
from stack.deploy.calibration import Calibration, check_samples
from stack.deploy.exportable import batch_feeds, export_network, training_path_network
from stack.deploy.orchestrate import DeploySpec, run_deploy


def bundle_calibration(pipeline, path: str | None, log=print) -> Calibration:
    """The calibration to bake: the file at `path`, checked against the network's cameras, or the nominal rig."""
    if path is None:
        return Calibration.from_rig(pipeline.data.rig)
    calibration = Calibration.load(path)
    calibration.name = calibration.name or Path(path).stem
    calibration.check_fits(pipeline.data.rig, f"calibration file {path}")
    log(f"camera calibration {calibration.name!r} from {path} (hash {calibration.hash[:12]})")
    return calibration


EXPORT_FILES = ("model.onnx", "pipeline.yaml", CALIBRATION_FILE)
"""What `stack export` writes into export.out_dir (deploy bundles go into folders beside them)."""


def check_export_folder(folder: Path) -> None:
    """export.out_dir must be new, empty, or stack's own: a previous export (a model.onnx carrying its pipeline
    hash) or deploy bundles beside it, never a bundle itself. Any other file there is the user's, and export would mix its files among them
    or overwrite one of the same name, so it is refused before anything is written."""
    from stack.errors import StackError

    entries = sorted(folder.iterdir()) if folder.is_dir() else []
    if is_deploy_folder(folder):
        raise StackError(f"export.out_dir {folder} is a deploy bundle (`stack deploy` wrote it): export would replace its "
                         f"{', '.join(EXPORT_FILES)}, and the bundle would then fail `stack deploy --verify`. Export "
                         f"into the folder that holds the bundles (export.out_dir={folder.parent}) or a new one "
                         f"(nothing was written).")
    if not entries or _holds_an_export(folder):
        return  # a previous export is replaced file by file, as each export does
    foreign = [entry.name for entry in entries if not is_deploy_folder(entry)]
    if foreign:
        shown = ", ".join(map(repr, foreign[:5])) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise StackError(f"export.out_dir {folder} is not empty and holds no previous export (a model.onnx written "
                         f"by `stack export`): found {shown}. Export writes {', '.join(EXPORT_FILES)} there and "
                         f"would mix them with (or overwrite) these files. Choose an empty or new export.out_dir, "
                         f"or move the files (nothing was written).")


def _holds_an_export(folder: Path) -> bool:
    """`folder/model.onnx` is an ONNX file whose metadata carries a pipeline hash, as `stack export` writes it."""
    from google.protobuf.message import DecodeError

    from stack.deploy.export import read_metadata

    try:
        return "pipeline_hash" in read_metadata(folder / "model.onnx")
    except (OSError, DecodeError):  # absent, a folder, unreadable, or not ONNX
        return False


def export_checkpoint(pipeline, state_dict: dict, checkpoint: str, log=print, calibration_file: str | None = None) -> dict:
    """Write `{export.out_dir}/model.onnx` and check it; returns the export summary."""
    from stack.config import pipeline_to_yaml
    from stack.deploy.export import check_parity, export_onnx
    from stack.deploy.validation import load_validation
    from stack.errors import StackError

    folder = Path(pipeline.export.out_dir)
    check_export_folder(folder)
    calibration = bundle_calibration(pipeline, calibration_file, log)
    try:
        samples, source = load_validation(pipeline, 2)
    except StackError as exc:
        raise StackError(f"parity needs validation samples: {exc}") from None
    check_samples(samples, calibration, f"the validation split of {pipeline.data.root} (parity samples)")
    network = export_network(pipeline, state_dict, calibration)
    log(f"exporting {checkpoint} to {folder / 'model.onnx'} (opset {pipeline.export.opset}) ...")
    exported = export_onnx(network.net, network.example, network.output_names, folder / "model.onnx",
                           pipeline.export.opset, network.metadata)
    # after the model: an export that fails before it leaves no pipeline.yaml that check_export_folder
    # would then take for a user's file
    (folder / "pipeline.yaml").write_text(pipeline_to_yaml(pipeline))
    (folder / CALIBRATION_FILE).write_text(calibration.to_yaml())
    feeds = [f for batch in samples for f in batch_feeds(batch)]
    reference = training_path_network(pipeline, state_dict, calibration)
    parity = check_parity(reference, exported.path, feeds, network.output_names, pipeline.export.parity_atol,
                          pipeline.export.parity_rtol)
    return {"path": exported.path, "ops": exported.ops, "tensorrt_problems": exported.tensorrt_problems,
            "parity": parity, "samples": f"{source}, against PyTorch pooling with bev_pool (geometry per call)"}


def calibration_feeds(network, reference, feeds: list) -> list:
    """INT8 calibration inputs: the quantizer feeds graph inputs only, so a stateful graph's frame pairs get the
    memory the PyTorch network made of the frame before (the fp32 memory whose ranges INT8 must cover)."""
    from stack.deploy.export import with_reference_memory

    return [with_reference_memory(f, reference, network.example) for f in feeds]


def _closed_loop_gate(pipeline):
    """The closed-loop gate bound to this pipeline's world, rig and drive settings."""
    from functools import partial

    from stack.deploy.gates.closed_loop import closed_loop_gate

    return partial(closed_loop_gate, pipeline)


def deploy_checkpoint(pipeline, state_dict: dict, checkpoint: str, target_name: str, log=print,
                      calibration_file: str | None = None, chosen_store: str | None = None,
                      allow_below_bar: bool = False) -> dict:
    """Build and gate the bundle `{export.out_dir}/{target_name}/` for one camera calibration; returns gate.json.
    `chosen_store`: the tracking store the user chose (DeploySpec.chosen_store); `allow_below_bar`: build a
    bundle marked not for deployment when the network is below the quality bar (run_deploy)."""
    from stack.config import load_target, pipeline_hash, pipeline_to_yaml
    from stack.deploy.gates.head_scores import head_budgets, make_evaluator, make_quality_evaluator
    from stack.deploy.validation import deploy_samples
    from stack.models.post_processing import post_processing_record

    target = load_target(target_name, pipeline)
    folder = Path(pipeline.export.out_dir) / target_name
    cameras = bundle_calibration(pipeline, calibration_file, log)
    log(f"reading samples ({pipeline.export.calibration_samples} calibration + {pipeline.export.sensitivity_samples} "
        f"sensitivity from the training split, {pipeline.export.accuracy_samples} accuracy from validation) ...")
    samples = deploy_samples(pipeline)
    calibration, accuracy, source = samples.calibration, samples.accuracy, samples.source
    check_samples(samples.sensitivity, cameras, f"sensitivity samples ({source})")
    check_samples(calibration, cameras, f"INT8 calibration samples ({source})")
    check_samples(accuracy, cameras, f"accuracy samples ({source})")
    network = export_network(pipeline, state_dict, cameras)
    reference = training_path_network(pipeline, state_dict, cameras)
    spec = DeploySpec(
        network.net, network.example, network.output_names, network.metadata,
        calibration=calibration_feeds(network, reference, [f for b in calibration for f in batch_feeds(b)]),
        accuracy_feeds=[f for b in accuracy for f in batch_feeds(b)],
        evaluator=make_evaluator(pipeline, accuracy, samples.accuracy_scenes), budgets=head_budgets(target, pipeline),
        quality_evaluator=make_quality_evaluator(pipeline, accuracy),
        sensitivity_feeds=[f for b in samples.sensitivity for f in batch_feeds(b)], sample_ids=samples.ids,
        reference=reference,
        samples_source=source, data_root=pipeline.data.root, chosen_store=chosen_store, checkpoint=str(checkpoint),
        pipeline_name=pipeline.name,
        pipeline_hash=pipeline_hash(pipeline), closed_loop=_closed_loop_gate(pipeline),
        post_processing=post_processing_record(pipeline),
        extra_files={"pipeline.yaml": pipeline_to_yaml(pipeline), CALIBRATION_FILE: cameras.to_yaml()})
    return run_deploy(spec, target_name, target, pipeline.export, folder, log, allow_below_bar)
