"""`stack drive --compare BEFORE AFTER`: two finished drives of the same episodes, compared episode by episode."""

import json

import numpy as np
import pytest

from stack.cli import main

FAMILIES = ("route", "stopped_vehicle")


def _rows(policy: str, scores, collisions=None) -> list[dict]:
    """One row per episode, two families x seeds, with a driving score and what it is made of."""
    collisions = collisions if collisions is not None else [0.0] * len(scores)
    return [{"policy": policy, "family": FAMILIES[i % 2], "seed": i // 2, "index": i,
             "metrics": {"driving_score": s, "pdms": s / 2, "route_completion": min(1.0, s + 0.1),
                         "collisions": c, "first_collision_s": None}}
            for i, (s, c) in enumerate(zip(scores, collisions))]


def _drive(folder, rows, split="tuning"):
    folder.mkdir(parents=True)
    meta = {"split": split, "episode_seconds": 8.0, "sim_hz": 10.0, "replan_hz": 2.0}
    (folder / "drive.json").write_text(json.dumps({"summary": {}, "rows": rows, "meta": meta}))
    return folder


SCORES = np.linspace(0.2, 0.9, 12)


def test_the_gain_is_paired_over_episodes_and_an_unchanged_baseline_shows_no_change(tmp_path, capsys):
    expert = _rows("expert", [1.0] * 12)
    before = _drive(tmp_path / "before", _rows("checkpoint", SCORES.tolist()) + expert)
    after = _drive(tmp_path / "after", _rows("checkpoint", (SCORES + 0.05).tolist(), [0.0] * 11 + [1.0]) + expert)
    assert main(["drive", "--compare", str(before), str(after / "drive.json")]) == 0
    table = capsys.readouterr().out
    # every episode gains 0.05: the interval is that exactly, though the episodes' own scores spread 0.2-0.9
    assert "| `checkpoint` | driving_score | 0.550 | 0.600 | +0.050 | **[+0.050, +0.050]** | 12 |" in table
    assert "| `checkpoint` | collisions | 0.000 | 0.083 | +0.083 |" in table  # one crash in 12: not excluding zero
    assert "| `expert` | driving_score | 1.000 | 1.000 | +0.000 | [+0.000, +0.000] | 12 |" in table


def test_one_network_each_under_other_names_is_paired(tmp_path, capsys):
    before = _drive(tmp_path / "before", _rows("checkpoint a.pt", SCORES.tolist()))
    after = _drive(tmp_path / "after", _rows("checkpoint b.pt", (SCORES - 0.1).tolist()))
    assert main(["drive", "--compare", str(before), str(after)]) == 0
    assert "| `checkpoint a.pt -> checkpoint b.pt` | driving_score | 0.550 | 0.450 | -0.100 |" in capsys.readouterr().out


@pytest.mark.parametrize("case, message", [
    ("missing", "expected a stack drive folder or its drive.json"),
    ("not-json", "found invalid JSON at line 1"),
    ("other-json", "'rows' list of episodes"),
    ("other-split", "did not drive the same worlds (drive.split 'tuning' against 'evaluation')"),
    ("other-episodes", "drove no episode in common"),
    ("other-networks", "share no network policy"),
    ("with-keys", "drives nothing"),
])
def test_bad_input_exits_2_with_what_to_do(tmp_path, capsys, case, message):
    before = _drive(tmp_path / "before", _rows("checkpoint", SCORES.tolist()))
    after, extra = tmp_path / "after", []
    if case == "not-json":
        after.write_text("episode,score\n")
    elif case == "other-json":
        after.write_text(json.dumps({"summary": {}, "results": []}))
    elif case == "other-split":
        _drive(after, _rows("checkpoint", SCORES.tolist()), split="evaluation")
    elif case == "other-episodes":
        rows = _rows("checkpoint", SCORES.tolist())
        _drive(after, [{**row, "seed": row["seed"] + 100} for row in rows])
    elif case == "other-networks":
        _drive(after, _rows("checkpoint b.pt", SCORES.tolist()) + _rows("checkpoint c.pt", SCORES.tolist()))
    elif case == "with-keys":
        _drive(after, _rows("checkpoint", SCORES.tolist()))
        extra = ["drive.seeds=[0]"]
    assert main(["drive", "--compare", str(before), str(after), *extra]) == 2
    assert message in capsys.readouterr().err
    assert (before / "drive.json").exists()  # nothing written over


def test_the_means_beside_the_gain_are_over_the_episodes_both_drove(tmp_path, capsys):
    before = _drive(tmp_path / "before", _rows("checkpoint", SCORES.tolist()))
    after = _drive(tmp_path / "after", _rows("checkpoint", SCORES.tolist())[:6])  # a shorter drive: its first 6
    assert main(["drive", "--compare", str(before), str(after)]) == 0
    shared = f"{SCORES[:6].mean():.3f}"
    assert f"| `checkpoint` | driving_score | {shared} | {shared} | +0.000 | [+0.000, +0.000] | 6 |" in capsys.readouterr().out
