"""A data folder someone hands you may hold a planted `.staging/`: its swap plan and manifests are checked
before the first change, so no path they name outside `data.root` (absolute, `..`, through a symbolic link)
is deleted or replaced, and a `.staging` that is a link is refused. Exit 2, nothing changed."""

import hashlib
import json
from pathlib import Path

import pytest

from stack.data import staging
from stack.errors import StackError

SHARD = "train/frames-000000.tar"


def dataset(root: Path, shard: str = SHARD, content: bytes = b"old shard") -> None:
    """A dataset of one shard (and its sidecars) with its manifest, as `stack data make` leaves one."""
    for suffix in (".tar", ".idx", ".sums"):
        (root / shard).parent.mkdir(parents=True, exist_ok=True)
        (root / shard).with_suffix(suffix).write_bytes(content)
    (root / "manifest.json").write_text(json.dumps({"splits": {"train": [{"path": shard}]}}))


def interrupted_swap(root: Path, delete, *, sign: bool = True, suffix=0) -> Path:
    """`.staging/` as a killed in-place swap would leave it (new dataset complete, plan written: the files to
    delete, the suffix of the new files' names in data.root), with `delete` and `suffix` planted."""
    stage = root / ".staging"
    dataset(stage, "train/frames-000001.tar", b"new shard")
    body = {"delete": delete, "manifest_sha256": hashlib.sha256((stage / "manifest.json").read_bytes()).hexdigest(),
            "suffix": suffix}
    if sign:  # anyone can compute a sha256: the path checks, not the digest, are what stop a crafted plan
        body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (stage / "swap.json").write_text(json.dumps(body if sign else {"delete": delete}))
    return stage


def snapshot(*folders: Path) -> dict:
    return {str(p): p.read_bytes() for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


def refused_unchanged(root: Path, match: str, watched: Path) -> None:
    """`stack data make`'s first step on `root` stops with a StackError matching `match` and changes nothing in
    `watched`."""
    before = snapshot(watched)
    with pytest.raises(StackError, match=match):
        staging.prepare(root, print)
    assert snapshot(watched) == before


@pytest.fixture
def victims(tmp_path):
    """Files of the user's outside data.root that a planted plan names."""
    (tmp_path / "victimdir").mkdir()
    (tmp_path / "victimdir" / "thesis.tar").write_text("years of work")
    (tmp_path / "victim.tar").write_text("keep me")
    return tmp_path


@pytest.mark.parametrize("planted", [["{victims}/victim.tar"], ["../victimdir/thesis.tar"], ["train/../../victim.tar"],
                                     ["train/notes.txt"], "not a list", [7]])
def test_a_planted_swap_plan_deletes_nothing_and_is_refused(victims, planted):
    root = victims / "data"
    dataset(root)
    if isinstance(planted, list):
        planted = [p.format(victims=victims) if isinstance(p, str) else p for p in planted]
    (root / "train" / "notes.txt").write_text("the user's notes")
    stage = interrupted_swap(root, planted)
    refused_unchanged(root, r"Nothing was changed|nothing was changed", victims)
    assert stage.is_dir()


@pytest.mark.parametrize("plan", ["unsigned", "edited", "foreign manifest", "garbage", "deep", "huge number",
                                  "suffix a path", "suffix negative"])
def test_a_swap_plan_the_project_did_not_write_is_refused(tmp_path, plan):
    root = tmp_path / "data"
    dataset(root)
    suffix = {"suffix a path": "/../../victim", "suffix negative": -1}.get(plan, 0)
    stage = interrupted_swap(root, [SHARD], sign=plan != "unsigned", suffix=suffix)
    record = json.loads((stage / "swap.json").read_text())
    if plan == "edited":
        record["delete"].append("train/frames-000000.idx")
        (stage / "swap.json").write_text(json.dumps(record))
    elif plan == "foreign manifest":
        (stage / "manifest.json").write_text(json.dumps({"splits": {"train": []}}))
    elif plan == "garbage":
        (stage / "swap.json").write_text("{not json")
    elif plan == "deep":  # json.loads would recurse past the interpreter's stack
        (stage / "swap.json").write_text("[" * 200_000 + "]" * 200_000)
    elif plan == "huge number":  # in a key the plan has: only the bounded reader refuses it
        (stage / "swap.json").write_text(json.dumps({**record, "sha256": 0})[:-2] + "1e999}")
    reason = {"deep": "nested more than 64 levels", "huge number": "the number 1e999"}.get(plan, "")
    refused_unchanged(root, rf"is not a swap plan `stack data make` wrote .*{reason}.*nothing was changed", tmp_path)


def test_a_shard_folder_that_links_outside_the_dataset_is_refused(victims):
    root = victims / "data"
    root.mkdir()
    (root / "train").symlink_to(victims / "victimdir")
    (root / "manifest.json").write_text(json.dumps({"splits": {"train": [{"path": "train/thesis.tar"}]}}))
    interrupted_swap(root, ["train/thesis.tar"])
    with pytest.raises(StackError, match=r"is reached through a symbolic link"):
        staging.prepare(root, print)
    assert (victims / "victimdir" / "thesis.tar").read_text() == "years of work"


def test_a_staged_shard_that_is_a_link_is_not_moved_in(victims):
    root = victims / "data"
    dataset(root)
    stage = interrupted_swap(root, [SHARD])
    staged = stage / "train" / "frames-000001.tar"
    staged.unlink()
    staged.symlink_to(victims / "victim.tar")
    with pytest.raises(StackError, match=r"the staging manifest names .* symbolic link"):
        staging.prepare(root, print)
    assert (root / SHARD).read_bytes() == b"old shard"


@pytest.mark.parametrize("kind", ["link", "file"])
def test_a_staging_folder_that_is_a_link_or_a_file_is_refused(victims, kind):
    root = victims / "data"
    dataset(root)
    outside = victims / "victimdir"
    if kind == "link":
        interrupted_swap(victims / "elsewhere", [str(outside / "thesis.tar")])
        (root / ".staging").symlink_to(victims / "elsewhere" / ".staging")
    else:
        (root / ".staging").write_text("mine")
    refused_unchanged(root, r"only ever makes a folder there. Nothing was changed", victims)


def test_a_swap_the_project_planned_is_still_finished(tmp_path):
    root = tmp_path / "data"
    dataset(root)
    (root / "train" / "frames-foo.tar").write_text("the user's own shard")
    interrupted_swap(root, [SHARD, "train/frames-000000.idx", "train/frames-000000.sums"])
    staging.prepare(root, print)
    assert sorted(p.name for p in (root / "train").iterdir()) == [
        "frames-000001.idx", "frames-000001.sums", "frames-000001.tar", "frames-foo.tar"]
    assert not (root / ".staging").exists()


def exchange_plan(root: Path, manifest_sha: str, sign: bool = True) -> Path:
    """The plan a swap by exchange writes beside data.root (`.NAME.swap.json`)."""
    body = {"manifest_sha256": manifest_sha}
    if sign:
        body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    path = staging.swap_folder(root).with_name(staging.swap_folder(root).name + ".json")
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize("planted", ["link", "folder without a plan", "unsigned plan", "plan for another dataset"])
def test_a_planted_swap_beside_data_root_is_refused_and_changes_nothing(victims, planted):
    """`.NAME.swap/` and its plan beside data.root are the project's only when the plan's sha256 holds and names
    the dataset in data.root or in that folder: a link there, a folder without a plan or a plan for something
    else is refused before anything is moved or deleted."""
    root = victims / "data"
    dataset(root)
    aside = staging.swap_folder(root)
    if planted == "link":
        aside.symlink_to(victims / "victimdir")
        exchange_plan(root, "0" * 64)
    else:
        dataset(aside, content=b"someone else's")
        if planted != "folder without a plan":
            exchange_plan(root, hashlib.sha256(b"x").hexdigest(), sign=planted != "unsigned plan")
    refused_unchanged(root, r"nothing was changed", victims)


def test_a_swap_killed_after_the_exchange_is_finished_without_deleting_the_users_files(tmp_path):
    """After the exchange the previous dataset waits beside data.root: the next run deletes the files its
    manifest lists and the second links of the user's files, and moves back what only it holds."""
    root = tmp_path / "data"
    dataset(root, "train/frames-000001.tar", b"new shard")
    aside = staging.swap_folder(root)
    dataset(aside)
    (aside / "README").write_text("mine")
    (aside / "train" / "notes.txt").write_text("only here")
    (root / "train" / "notes.txt").parent.mkdir(exist_ok=True)
    os_link = __import__("os").link
    os_link(aside / "README", root / "README")
    exchange_plan(root, hashlib.sha256((root / "manifest.json").read_bytes()).hexdigest())
    staging.prepare(root, print)
    assert not aside.exists() and not list(tmp_path.glob(".data.swap*"))
    assert (root / "README").read_text() == "mine" and (root / "train" / "notes.txt").read_text() == "only here"
    assert (root / "train" / "frames-000001.tar").read_bytes() == b"new shard"
    assert not (root / SHARD).exists()
