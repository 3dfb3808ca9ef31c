"""The quality gate of `stack deploy`: only a network that clears `stack eval`'s bars and beats the blind
policies in closed loop ships; below that bar a bundle is built only on request, marked not for deployment."""

import dataclasses
import json

import pytest
from deploy_fixture_net import (RECIPE_LIKE_METRICS, drives, example_inputs, heads_like_the_recipe, make_net,
                                make_samples, segmentation_error)

from stack.config import load_pipeline, load_target
from stack.deploy.gates.accuracy import HeadBudget
from stack.deploy.orchestrate import DeploySpec, run_deploy


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(["configs/pipeline.yaml"], ["export.calibration_samples=8", "export.timing_runs=20",
                                                     "export.timing_warmup=1", "export.keep_fp32=[bev_pool]"])


def _deploy(pipeline, folder, allow_below_bar=False, **quality):
    net, feeds = make_net(), make_samples(12, seed=3)
    spec = DeploySpec(net, example_inputs(), ["segmentation", "speed"], {"pipeline_hash": "test"}, feeds[:8],
                      feeds[8:], segmentation_error(net, feeds[8:]),
                      [HeadBudget("segmentation", "seg_rel_error", 0.05, False)], "fixture samples", "fixture.pt",
                      "fixture", "test", **{"closed_loop": drives(0.2), "quality_evaluator": heads_like_the_recipe,
                                            **quality})
    target = dataclasses.replace(load_target("cpu", pipeline), min_fps=0.1, max_p99_latency_ms=1e6)
    return run_deploy(spec, "cpu", target, pipeline.export, folder, log=lambda m: None, allow_below_bar=allow_below_bar)


def test_a_network_that_clears_every_bar_is_for_deployment(pipeline, tmp_path):
    result = _deploy(pipeline, tmp_path / "good")
    assert result["passed"] and result["for_deployment"] and result["quality"]["passed"], result["failures"]
    beaten = {(c["baseline"], c["metric"]) for c in result["quality"]["closed_loop"]["comparisons"] if c["beats"]}
    assert beaten == {(b, m) for b in ("constant_velocity", "ego_rollout") for m in ("driving_score", "pdms")}
    report = (tmp_path / "good" / "report.md").read_text()
    assert report.startswith("# Deploy report: cpu — PASS\n") and "## Quality" in report


@pytest.mark.parametrize("quality, says", [
    ({"quality_evaluator": lambda run: {**RECIPE_LIKE_METRICS, "detection/mAP": 0.0, "segmentation/mIoU": 0.07}},
     ["quality: detection mAP 0.000 does not clear its bar", "quality: segmentation mIoU 0.070 does not clear"]),
    ({"closed_loop": drives(-0.1)},  # INT8 equals fp32, and both drive worse than a policy that never looks
     ["quality: closed loop: the network does not beat constant_velocity in driving_score",
      "quality: closed loop: the network does not beat ego_rollout in pdms"]),
    ({"closed_loop": drives(0.0)}, ["does not beat ego_rollout in driving_score"]),  # a tie is not a gain
    ({"quality_evaluator": None}, ["quality: heads not judged"]),
    ({"closed_loop": None}, ["quality: closed loop not judged"]),
])
def test_a_network_below_the_bar_fails_the_deploy(pipeline, tmp_path, quality, says):
    result = _deploy(pipeline, tmp_path / "bad", **quality)
    assert not result["passed"] and not result["for_deployment"]
    for needle in says:
        assert any(needle in reason for reason in result["failures"]), (needle, result["failures"])
    if quality.get("closed_loop") is not None and "closed_loop" in quality:
        assert result["closed_loop"]["passed"] is True  # INT8 is within budget of fp32: that alone no longer ships
    assert (tmp_path / "bad" / "report.md").read_text().startswith("# Deploy report: cpu — FAIL")


def test_allow_below_bar_builds_a_bundle_marked_not_for_deployment_that_the_runtime_refuses(pipeline, tmp_path):
    from stack.cli import main
    from stack.deploy.bundle import verify_bundle
    from stack.deploy.runner import DeployedNetwork, NotForDeployment

    folder = tmp_path / "experiment"
    result = _deploy(pipeline, folder, allow_below_bar=True, closed_loop=drives(-0.1))
    assert result["passed"] and not result["for_deployment"] and not result["failures"]
    assert any("does not beat ego_rollout" in reason for reason in result["below_bar"])
    report = (folder / "report.md").read_text()
    assert report.startswith("# Deploy report: cpu — PASS, NOT FOR DEPLOYMENT") and "BELOW THE BAR" in report
    assert verify_bundle(folder)["for_deployment"] is False  # intact: it verifies, and says what it is
    with pytest.raises(NotForDeployment, match="NOT FOR DEPLOYMENT: it is below the quality bar"):
        DeployedNetwork.open(folder)
    with pytest.raises(Exception) as opened:  # asked: the quality mark no longer stops it (the stand-in has no
        DeployedNetwork.open(folder, allow_below_bar=True)  # camera calibration, which is the next check)
    assert not isinstance(opened.value, NotForDeployment) and "calibration" in str(opened.value)
    assert main(["deploy", "--verify", str(folder)]) == 1
    assert json.loads((folder / "gate.json").read_text())["allow_below_bar"] is True
