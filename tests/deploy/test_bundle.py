"""The bundle on disk: swapped in whole, vouched for by sha256, never left half old and half new.

A re-deploy that is killed (SIGKILL at named fail points, in a real subprocess) must leave
the previous bundle exactly as it was; a completed one must leave nothing of the old
bundle behind; and `verify_bundle` / `stack deploy --verify` must refuse any bundle whose
files are not the ones its gate ran on.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stack.deploy.bundle import BundleMismatch, bundle_files, seal, stage, verify_bundle
from stack.errors import StackError

HERE = Path(__file__).parent
REPO = HERE.parents[1]

# Runs one deploy of the stand-in network (seed from argv) into the folder argv[1]: the kill tests run it
# in a subprocess so that a fail point can SIGKILL it; the other tests call the same function in-process.
DEPLOY_SCRIPT = """
import dataclasses, sys
from stack.config import load_pipeline, load_target
from stack.deploy.gates.accuracy import HeadBudget
from stack.deploy.orchestrate import DeploySpec, run_deploy
from deploy_fixture_net import drives, example_inputs, heads_like_the_recipe, make_net, make_samples, segmentation_error

def deploy(folder, seed):
    net = make_net(seed=seed)
    feeds = make_samples(12, seed=3)
    evaluate = segmentation_error(net, feeds[8:])

    pipeline = load_pipeline(["configs/pipeline.yaml"], ["export.calibration_samples=8", "export.timing_runs=20",
                                                         "export.timing_warmup=1", "export.keep_fp32=[bev_pool]"])
    target = dataclasses.replace(load_target("cpu", pipeline), min_fps=0.1, max_p99_latency_ms=1e6)
    spec = DeploySpec(net, example_inputs(), ["segmentation", "speed"], {"pipeline_hash": "test"}, feeds[:8], feeds[8:],
                      evaluate, [HeadBudget("segmentation", "seg_rel_error", 0.05, False)], "fixture samples",
                      "fixture.pt", "fixture", "test", extra_files={"pipeline.yaml": "name: fixture\\n"},
                      closed_loop=drives(0.2), quality_evaluator=heads_like_the_recipe)
    return run_deploy(spec, "cpu", target, pipeline.export, folder, log=lambda m: None)

if __name__ == "__main__":
    from pathlib import Path
    deploy(Path(sys.argv[1]), int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def deploy_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("script")
    (folder / "deploy_once.py").write_text(DEPLOY_SCRIPT)
    sys.path.insert(0, str(folder))
    import deploy_once

    yield folder / "deploy_once.py", deploy_once.deploy
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def gated(tmp_path_factory, deploy_module):
    """A passed bundle of the seed-0 network; tests copy it before changing anything."""
    folder = tmp_path_factory.mktemp("bundles") / "cpu"
    result = deploy_module[1](folder, 0)
    assert result["passed"], result["failures"]
    return folder


def _copy(bundle: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(bundle, tmp_path / "cpu"))


def test_gate_json_vouches_for_every_file_and_the_checkpoint(gated):
    gate = json.loads((gated / "gate.json").read_text())
    assert set(gate["files"]) == {p.name for p in gated.iterdir()} - {"gate.json"}
    assert {"model.onnx", "model.int8.onnx", "report.md", "pipeline.yaml"} <= set(gate["files"])
    assert gate["files"] == bundle_files(gated)
    assert verify_bundle(gated)["passed"] is True


@pytest.mark.parametrize("damage", ["changed", "missing", "extra"])
def test_verify_refuses_a_bundle_whose_files_are_not_the_gated_ones(gated, tmp_path, damage):
    bundle = _copy(gated, tmp_path)
    if damage == "changed":
        with open(bundle / "model.int8.onnx", "r+b") as handle:  # one flipped byte in the shipped model
            handle.seek(200)
            byte = handle.read(1)
            handle.seek(200)
            handle.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "missing":
        (bundle / "model.onnx").unlink()
    else:
        (bundle / "model.engine").write_bytes(b"an engine nobody gated")
    with pytest.raises(BundleMismatch) as caught:
        verify_bundle(bundle)
    expected = {"changed": "model.int8.onnx: changed", "missing": "model.onnx: missing",
                "extra": "model.engine: not part of the gated bundle"}[damage]
    assert expected in str(caught.value)


@pytest.mark.parametrize("edit", ["checksum", "verdict"])
def test_verify_refuses_an_edited_gate_json(gated, tmp_path, edit):
    bundle = _copy(gated, tmp_path)
    gate = json.loads((bundle / "gate.json").read_text())
    if edit == "checksum":
        gate["files"]["model.onnx"] = 5
    else:
        gate["passed"] = "yes"
    (bundle / "gate.json").write_text(json.dumps(gate))
    with pytest.raises(BundleMismatch, match="edited"):
        verify_bundle(bundle)


def _resealed(bundle: Path, edit) -> Path:
    """`bundle` with gate.json edited by `edit(gate)` and its sha256 recomputed, as an attacker can."""
    gate = json.loads((bundle / "gate.json").read_text())
    edit(gate)
    (bundle / "gate.json").write_text(seal(gate))
    return bundle


def test_gate_json_carries_its_own_sha256_and_an_edit_breaks_it(gated, tmp_path):
    bundle = _copy(gated, tmp_path)
    gate = json.loads((bundle / "gate.json").read_text())
    gate["target_description"] = "something else"
    (bundle / "gate.json").write_text(json.dumps(gate))
    with pytest.raises(BundleMismatch, match="does not match its own sha256"):
        verify_bundle(bundle)


def _ship(name):
    def edit(gate):
        gate["shipped"]["file"] = name
    return edit


def _ship_the_other_model(gate):
    """Ship the model the figures did not choose (which one they chose is measured, so it depends on the host)."""
    gate["shipped"]["file"] = "model.onnx" if gate["shipped"]["file"] == "model.int8.onnx" else "model.int8.onnx"


def _set(path: str, value):
    def edit(gate):
        *parents, key = path.split(".")
        node = gate
        for parent in parents:
            node = node[int(parent)] if isinstance(node, list) else node[parent]
        node[key] = value
    return edit


def _fp32_drives_into_everything(gate):
    """Every fp32 episode scored 0: the driving bar the quality verdict claims no longer follows."""
    for row in gate["closed_loop"]["episode_scores"]:
        if row["policy"] == "fp32":
            row["metrics"] = {"driving_score": 0.0, "pdms": 0.0}


def _heads_say_not_judged_but_passed(gate):
    """The heads' record replaced by a "not judged" one that still claims to pass (not judged is not good enough)."""
    gate["quality"]["heads"] = {"passed": True, "rows": [], "metrics": {}, "source": "edited",
                                "not_judged": "nothing was scored"}


def _interval_past_the_budget(gate):
    """A head's interval now reaches past its budget: inconclusive, which the target does not let pass."""
    head = gate["accuracy"]["heads"][0]
    head["low"], head["high"], head["inconclusive_passes"] = head["drop"] - 1e-3, head["budget"] + 0.01, False


@pytest.mark.parametrize("edit, says", [
    (_interval_past_the_budget, "the accuracy verdict says True but its figures say False"),
    (_ship("../../../../etc/passwd"), r"ships '\.\./\.\./\.\./\.\./etc/passwd'; expected one of the bundle's own"),
    (_ship("pipeline.yaml"), "ships 'pipeline.yaml'"),
    (_ship_the_other_model, r"it ships 'model(\.int8)?\.onnx', but its figures choose 'model(\.int8)?\.onnx'"),
    (_set("fps.min_fps", 1e9), "the fps verdict says True but its figures say False"),
    (_set("fps.median_ms", 1e9), "the fps verdict says True but its figures say False"),
    (_set("accuracy.heads.0.drop", 1.0), "the accuracy verdict says True but its figures say False"),
    (_set("accuracy.heads.0.budget", -1.0), "the accuracy verdict says True but its figures say False"),
    (_set("export.parity.0.max_abs_error", 1e9), "the overall verdict is PASS, but parity failed"),
    (_set("passed", False), "the overall verdict is FAIL, but no failure is listed"),
    (_set("failures", ["edited"]), "the overall verdict is PASS, but its failures list failed"),
    (_set("fps", None), "misshapen"),
    (_set("quality.heads.metrics.segmentation/mIoU", 0.01), "head verdicts do not follow from its recorded head"),
    (_heads_say_not_judged_but_passed, "head verdicts do not follow from its recorded head"),
    (_fp32_drives_into_everything, "the quality gate's closed-loop verdict says True but its episode scores say False"),
    (_set("for_deployment", False), "for_deployment says False"),
    (_set("quality.passed", False), "the quality verdict is not the conjunction"),
    (_set("below_bar", ["edited"]), "the list of bars the network is below does not match"),
])
def test_verify_recomputes_every_verdict_and_the_shipped_model_from_the_figures(gated, tmp_path, edit, says):
    bundle = _resealed(_copy(gated, tmp_path), edit)
    with pytest.raises(BundleMismatch, match=says):
        verify_bundle(bundle)


def test_a_file_swapped_for_a_link_outside_the_bundle_is_refused(gated, tmp_path):
    bundle = _copy(gated, tmp_path / "b")
    outside = tmp_path / "outside.onnx"
    outside.write_bytes(b"not the gated model")
    (bundle / "model.onnx").unlink()
    (bundle / "model.onnx").symlink_to(outside)
    _resealed(bundle, lambda gate: gate["files"].update({"model.onnx": bundle_files(bundle)["model.onnx"]}))
    with pytest.raises(BundleMismatch, match=r"holds symbolic links \(model.onnx\)"):
        verify_bundle(bundle)


def test_a_gate_json_nested_200000_deep_is_a_clear_error(gated, tmp_path, capsys):
    from stack.cli import main

    bundle = _copy(gated, tmp_path)
    (bundle / "gate.json").write_text("[" * 200000 + "]" * 200000)
    assert main(["deploy", "--verify", str(bundle)]) == 1
    out = capsys.readouterr().out
    assert "nested more than 64 levels deep" in out and "Traceback" not in out


def test_an_unvouched_file_is_named_before_any_file_is_hashed(gated, tmp_path, monkeypatch):
    """A file gate.json does not list fails on its name: a 1 TiB sparse file is never read (hashing it would take
    hours), and a name holding terminal escapes is printed escaped."""
    import stack.deploy.bundle as bundle_module

    bundle = _copy(gated, tmp_path)
    with (bundle / "huge\x1b[2J.bin").open("wb") as handle:
        handle.truncate(1024 ** 4)
    hashed = []
    monkeypatch.setattr(bundle_module, "sha256_file", lambda path: hashed.append(path) or "0" * 64)
    with pytest.raises(BundleMismatch) as caught:
        verify_bundle(bundle)
    assert hashed == [] and "huge\\x1b[2J.bin: not part of the gated bundle" in str(caught.value)
    assert "\x1b" not in str(caught.value)


def test_what_build_engine_sh_writes_on_the_device_does_not_break_verification(gated, tmp_path):
    bundle = _copy(gated, tmp_path)
    (bundle / "device").mkdir()
    (bundle / "device" / "orin.engine").write_bytes(b"built on the car")
    (bundle / "device" / "trtexec.log").write_text("GPU Compute Time: ...")
    verify_bundle(bundle)


def test_stack_deploy_verify_exit_codes(gated, tmp_path, capsys):
    from stack.cli import main

    assert main(["deploy", "--verify", str(gated)]) == 0
    assert "match gate.json" in capsys.readouterr().out
    bundle = _copy(gated, tmp_path)
    (bundle / "report.md").write_text("# PASS\n")
    assert main(["deploy", "--verify", str(bundle)]) == 1
    assert "report.md: changed" in capsys.readouterr().out
    assert main(["deploy", "--verify", str(tmp_path / "nothing")]) == 2
    assert "not a deploy bundle" in capsys.readouterr().err
    resealed = _resealed(_copy(gated, tmp_path / "escapes"), lambda gate: gate.update(checkpoint="run\x1b]0;owned\x07.pt"))
    assert main(["deploy", "--verify", str(resealed)]) == 0
    out = capsys.readouterr().out
    assert "run\\x1b]0;owned\\x07.pt" in out and "\x1b" not in out, "gate.json's text is printed escaped"


def test_a_completed_redeploy_leaves_nothing_of_the_old_bundle(gated, tmp_path, deploy_module):
    bundle = _copy(gated, tmp_path)
    (bundle / "stale.engine").write_bytes(b"from an earlier build")
    old_model = (bundle / "model.onnx").read_bytes()
    deploy_module[1](bundle, 1)
    assert not (bundle / "stale.engine").exists()
    assert (bundle / "model.onnx").read_bytes() != old_model
    verify_bundle(bundle)
    assert not list(tmp_path.glob(".cpu.staging-*")), "the staging folder (now the old bundle) is removed"


def test_a_folder_of_user_files_is_never_replaced(tmp_path, deploy_module):
    folder = tmp_path / "cpu"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(StackError, match="not a deploy bundle"):
        deploy_module[1](folder, 0)
    assert (folder / "notes.txt").read_text() == "mine"


def test_stale_staging_folders_of_dead_runs_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".cpu.staging-{dead.pid}"
    stale.mkdir()
    (stale / "model.onnx").write_bytes(b"half")
    staging = stage(tmp_path / "cpu")
    assert not stale.exists() and staging.is_dir() and not any(staging.iterdir())


@pytest.mark.parametrize("point", ["deploy-after-quantize", "deploy-before-swap", "deploy-after-swap"])
def test_a_killed_redeploy_leaves_a_bundle_that_verifies(gated, tmp_path, deploy_module, point):
    bundle = _copy(gated, tmp_path)
    before = bundle_files(bundle)
    env = dict(os.environ, STACK_FAIL_POINT=point,
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(deploy_module[0]), str(bundle), "1"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    gate = verify_bundle(bundle)  # whatever is at the bundle's name is whole and vouched for
    if point == "deploy-after-swap":
        assert gate["files"] != before, "the new bundle was already swapped in"
    else:
        assert bundle_files(bundle) == before, "the previous bundle is untouched"
    deploy_module[1](bundle, 1)  # the next deploy cleans up after the killed one
    assert not list(tmp_path.glob(".cpu.staging-*"))
    verify_bundle(bundle)


def test_a_full_disk_during_a_redeploy_is_one_line_and_keeps_the_previous_bundle(gated, tmp_path, deploy_module):
    """A file-size limit while the new bundle is written (a full disk raises the same way): DiskFull names the
    folder and says the previous bundle is intact, which still verifies; the staging folder is removed."""
    import resource

    from stack.durable import DiskFull

    bundle = _copy(gated, tmp_path)
    before = bundle_files(bundle)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, hard))  # the ONNX files are ~300 kB
    try:
        with pytest.raises(DiskFull) as raised:
            deploy_module[1](bundle, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"no room to write under '{tmp_path}': a file reached the size limit for files" in str(raised.value)
    assert f"The bundle at '{bundle}' is as it was" in str(raised.value)
    assert bundle_files(bundle) == before and not list(tmp_path.glob(".cpu.staging-*"))
    verify_bundle(bundle)


def test_post_processing_recorded_before_a_guard_rule_was_removed_verifies_while_the_rule_was_off(tmp_path):
    """A bundle deployed at pipeline schema 2 records the guard settings schema 3 removed (gate.json's
    post_processing and closed_loop.guard, its pipeline.yaml): off, they verify as today's settings; a bundle gated
    with one on is refused, saying why the rule went (it would drive without it)."""
    from stack.deploy.bundle import _check_post_processing

    schema_2 = REPO / "tests" / "assets" / "schema2"  # a network pinned under schema 2: its pipeline and card's record
    recorded = json.loads((schema_2 / "post_processing.json").read_text())
    assert recorded["guard"]["confirm_below"] == 0.0 and recorded["guard"]["defer_below"] == 0.0
    (tmp_path / "pipeline.yaml").write_text((schema_2 / "pipeline.yaml").read_text())  # schema 2, the keys at 0
    _check_post_processing(tmp_path, {"post_processing": recorded, "closed_loop": {"guard": recorded["guard"]}})
    on = {**recorded, "guard": {**recorded["guard"], "confirm_below": 0.4}}
    with pytest.raises(BundleMismatch, match="guard.confirm_below: 0.4. It was removed in pipeline schema 3"):
        _check_post_processing(tmp_path, {"post_processing": on, "closed_loop": {"guard": on["guard"]}})
