"""Parallel evaluation: an episode driven in a worker process is the episode driven in this one."""

import numpy as np
import torch

from stack.deploy.network_policies import bundle_spec, checkpoint_spec
from stack.sim import drive
from stack.sim.drive import forget_worlds, run_tasks, score_rows
from stack.sim.policies import PolicySpec
from stack.sim.scenarios import episode_specs
from tests.sim.test_drive import micro_pipeline


def _drive(pipeline, specs, episodes, workers):
    threads = torch.get_num_threads()
    try:
        return run_tasks(pipeline, [(s, e, None) for s in specs for e in episodes], workers)
    finally:
        torch.set_num_threads(threads)  # the in-process path sets one thread, as each worker runs


def _onnx(pipeline, state_dict, path):
    from stack.deploy.calibration import Calibration
    from stack.deploy.export import export_onnx
    from stack.deploy.exportable import export_network

    network = export_network(pipeline, state_dict, Calibration.from_rig(pipeline.data.rig))
    export_onnx(network.net, network.example, network.output_names, path, pipeline.export.opset, network.metadata)
    return str(path)


def test_worker_processes_replay_the_episodes_of_one_process(tmp_path):
    """PyTorch and ONNX Runtime networks built in this process first (as latency measurement does), then
    forked into the workers: what the deploy gate and `stack drive` run."""
    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.models import build_model

    pipeline = micro_pipeline("drive.episode_seconds=3.0")
    torch.manual_seed(0)
    weights = build_model(pipeline).state_dict()
    checkpoint = save_model_checkpoint(tmp_path / "model.pt", pipeline, weights)
    specs = [checkpoint_spec("checkpoint", str(checkpoint), latency_s=0.2),
             bundle_spec("fp32", "", _onnx(pipeline, weights, tmp_path / "model.onnx"), latency_s=0.1),
             PolicySpec("expert", "expert")]
    episodes = episode_specs(["lead_brake", "cut_in"], 2, [0], 3.0)
    alone = score_rows(_drive(pipeline, specs, episodes, workers=1))
    parallel = score_rows(_drive(pipeline, specs, episodes, workers=2))
    assert [(r["policy"], r["index"]) for r in parallel] == [(r["policy"], r["index"]) for r in alone]
    for one, other in zip(alone, parallel):
        assert np.array_equal(one["trace"].ego, other["trace"].ego), (one["policy"], one["family"])
        assert np.array_equal(one["trace"].agents, other["trace"].agents)
        assert one["metrics"]["pdms"] == other["metrics"]["pdms"]


def test_a_kept_world_drives_its_episode_as_a_newly_built_one():
    """Every policy of an evaluation drives a copy of the world built for the episode's first policy: a drive
    leaves the kept world unstepped, and the next drive through it is the drive through a new one."""
    pipeline = micro_pipeline("drive.episode_seconds=3.0")
    expert = PolicySpec("expert", "expert")
    episodes = episode_specs(["lead_brake", "cut_in"], 2, [0], 3.0)
    forget_worlds()
    built = _drive(pipeline, [expert], episodes, workers=1)
    assert len(drive._pristine) == 2 and all(world.step_index == 0 for world in drive._pristine.values())
    kept = _drive(pipeline, [expert, PolicySpec("constant velocity", "constant_velocity")], episodes, workers=1)
    forget_worlds()
    again = _drive(pipeline, [PolicySpec("constant velocity", "constant_velocity")], episodes, workers=1)
    for one, other in zip(built + again, kept[:2] + kept[2:]):
        assert one["policy"] == other["policy"] and one["index"] == other["index"]
        assert np.array_equal(one["trace"].ego, other["trace"].ego), (one["policy"], one["family"])
        assert np.array_equal(one["trace"].agents, other["trace"].agents)
