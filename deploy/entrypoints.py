"""Entry points behind `stack export` and `stack deploy` (the CLI calls these): checkpoint in, ONNX / bundle out.

They turn a checkpoint and its pipeline into a `DeploySpec`; `stack.deploy.orchestrate` then runs the
steps and gates in order and writes the bundle.
"""

from __future__ import annotations

from pathlib import Path

from stack.deploy.orchestrate import DeploySpec, run_deploy
from stack.deploy.network import batch_feeds, export_network


def export_checkpoint(pipeline, state_dict: dict, checkpoint: str, log=print) -> dict:
    """Write `{export.out_dir}/model.onnx` and check it; returns the export summary."""
    from stack.config import pipeline_to_yaml
    from stack.deploy.export import check_parity, export_onnx
    from stack.deploy.validation import load_validation
    from stack.errors import StackError

    network = export_network(pipeline, state_dict)
    folder = Path(pipeline.export.out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pipeline.yaml").write_text(pipeline_to_yaml(pipeline))
    log(f"exporting {checkpoint} to {folder / 'model.onnx'} (opset {pipeline.export.opset}) ...")
    exported = export_onnx(network.net, network.example, network.output_names, folder / "model.onnx",
                           pipeline.export.opset, network.metadata)
    try:
        samples, source = load_validation(pipeline, 2)
    except StackError as exc:
        raise StackError(f"parity needs validation samples: {exc}") from None
    feeds = [f for batch in samples for f in batch_feeds(batch)]
    parity = check_parity(network.net, exported.path, feeds, network.output_names, pipeline.export.parity_atol,
                          pipeline.export.parity_rtol)
    return {"path": exported.path, "ops": exported.ops, "tensorrt_problems": exported.tensorrt_problems,
            "parity": parity, "samples": source}


def deploy_checkpoint(pipeline, state_dict: dict, checkpoint: str, target_name: str, log=print) -> dict:
    """Build and gate the bundle `{export.out_dir}/{target_name}/`; returns gate.json's content."""
    from stack.config import load_target, pipeline_hash, pipeline_to_yaml
    from stack.deploy.evaluate import head_budgets, make_evaluator
    from stack.deploy.validation import calibration_and_accuracy

    target = load_target(target_name, pipeline)
    folder = Path(pipeline.export.out_dir) / target_name
    network = export_network(pipeline, state_dict)
    log(f"reading validation samples ({pipeline.export.calibration_samples} calibration + "
        f"{pipeline.export.accuracy_samples} accuracy) ...")
    calibration, accuracy, source = calibration_and_accuracy(pipeline)
    spec = DeploySpec(
        network.net, network.example, network.output_names, network.metadata,
        calibration=[f for b in calibration for f in batch_feeds(b)],
        accuracy_feeds=[f for b in accuracy for f in batch_feeds(b)],
        evaluator=make_evaluator(pipeline, accuracy), budgets=head_budgets(target, pipeline),
        samples_source=source, checkpoint=str(checkpoint), pipeline_name=pipeline.name,
        pipeline_hash=pipeline_hash(pipeline), extra_files={"pipeline.yaml": pipeline_to_yaml(pipeline)})
    return run_deploy(spec, target_name, target, pipeline.export, folder, log)
