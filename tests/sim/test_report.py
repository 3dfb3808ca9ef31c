"""The closed-loop report (drive.md / drive.json / drive.png) and the episode clips (MP4)."""

import json
import math
import os
import stat

import numpy as np
import pytest
from PIL import Image

from stack.sim import drive_clips as clips
from stack.sim.world.roads import SEG, GroundRaster
from stack.sim.drive_report import COLUMNS, fmt, write_atomic, write_report

FAMILIES = ("lead_brake", "jaywalker")
POLICIES = ("expert", "checkpoint", "constant_velocity")


def _stats(mean, std, episodes=6) -> dict:
    return {"mean": mean, "std": std, "episodes": episodes}


def _summary() -> dict:
    """Hand-made `aggregate` output: the expert on top, the checkpoint close, the blind baseline far below."""
    base = {"expert": 0.95, "checkpoint": 0.71, "constant_velocity": 0.312}
    summary = {}
    for policy, score in base.items():
        summary[policy] = {}
        for k, family in enumerate(FAMILIES + ("all",)):
            metrics = {key: _stats(round(score - 0.05 * k, 4), 0.02 + 0.01 * k) for key, _, _ in COLUMNS}
            metrics["collisions"] = _stats(0.0 if policy == "expert" else 0.5 + k, 0.1)
            metrics["first_collision_s"] = _stats(float("nan"), float("nan"))
            summary[policy][family] = metrics
    summary["checkpoint"]["jaywalker"]["pdms"] = _stats(0.5124, 0.0301)
    summary["constant_velocity"]["jaywalker"]["pdms"] = _stats(0.5249, 0.0417)
    return summary


def _rows() -> list:
    rows = []
    for policy in POLICIES:
        for index in range(4):
            score = 0.2 * index + (0.5 if policy == "expert" else 0.0)
            rows.append({"policy": policy, "family": FAMILIES[index % 2], "seed": 100 + index // 2, "index": index,
                         "latency_ms": 35.2 if policy == "checkpoint" else 0.0, "replans": 16,
                         "timings": {"render": 1.0 if policy == "checkpoint" else 0.0, "policy": 0.25 * index,
                                     "simulation": 0.5, "wall": 2.0},
                         "metrics": {"driving_score": score, "pdms": score, "route_completion": 1.0,
                                     "collisions": float(index == 0), "first_collision_s": 2.5 if index == 0 else math.nan}})
    return rows


def _meta() -> dict:
    return {"pipeline": "tiny", "sources": {"checkpoint": "runs/tiny/last.ckpt"}, "cpu": "AMD EPYC test",
            "episodes": 4, "seeds": [100, 101], "scenarios": list(FAMILIES), "episode_seconds": 8.0,
            "sim_hz": 10.0, "replan_hz": 4.0,
            "latency": {"checkpoint": {"ms": 35.2, "how": "measured on this host"},
                        "expert": {"ms": 0.0, "how": "none (baseline)"}},
            "clips": {"checkpoint": [{"file": "clips/checkpoint-lead_brake-seed100-ep000.mp4", "driving_score": 0.0},
                                     {"file": "clips/checkpoint-best-jaywalker-seed101-ep003.mp4", "driving_score": 0.6,
                                      "index": 3, "kind": "best"}]}}


@pytest.fixture()
def report(tmp_path):
    files = write_report(tmp_path / "drive", _summary(), _rows(), _meta())
    return tmp_path / "drive", files


def test_report_files_and_markdown_numbers(report):
    folder, files = report
    assert [f.name for f in files] == ["drive.md", "drive.json", "drive.png"]
    assert all(f.is_file() and f.stat().st_size > 0 for f in files)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    text = (folder / "drive.md").read_text()
    for name in POLICIES:
        assert f"`{name}`" in text
    for family in FAMILIES:
        assert f"## {family}" in text
    assert "`constant_velocity` (blind)" in text and "`expert` (privileged)" in text
    assert "runs/tiny/last.ckpt" in text and "35.2 ms (measured on this host)" in text
    assert "simulation 10 Hz" in text and "seeds 100, 101" in text
    # overall row of the checkpoint: driving score 0.71 - 0.05 * 2 = 0.61, std 0.04; best (expert) in bold
    overall = text.split("## Overall")[1].split("##")[0]
    checkpoint_row = next(line for line in overall.splitlines() if line.startswith("| `checkpoint`"))
    assert checkpoint_row.split(" | ")[1] == "0.610 ± 0.040"
    assert "**0.850 ± 0.040**" in overall
    # a PDMS difference just over 0.01 must stay visible
    jaywalker = text.split("## jaywalker")[1].split("##")[0]
    assert "0.512 ± 0.030" in jaywalker and "0.525 ± 0.042" in jaywalker
    # cameras against blind: checkpoint 0.61 vs constant velocity 0.212 overall
    assert "| all | `checkpoint` 0.610 ± 0.040 | `constant_velocity` 0.212 ± 0.040 | +0.398 |" in text
    # worst episodes: the lowest driving score first, with the clip written for it
    worst = text.split("## Worst episodes")[1].split("##")[0]
    assert "`clips/checkpoint-lead_brake-seed100-ep000.mp4`" in worst
    first_checkpoint = next(line for line in worst.splitlines() if line.startswith("| `checkpoint`"))
    assert first_checkpoint.startswith("| `checkpoint` | 0 | lead_brake | 100 | 0.000 |")
    assert "-best-" not in worst  # a best-episode clip is not listed among the worst
    best = text.split("## Best episode of each family")[1].split("##")[0]
    assert "| `checkpoint` | jaywalker | 3 | 101 | 0.600 |" in best and "`clips/checkpoint-best-jaywalker-seed101-ep003.mp4`" in best


def test_files_readable_by_others_and_replaced_whole(report, tmp_path):
    """Reports are shared (umask permissions, not mkstemp's 0600); a failed write keeps the previous file."""
    folder, files = report
    mask = os.umask(0)
    os.umask(mask)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask for f in files)
    before = (folder / "drive.md").read_bytes()

    def broken(temporary):
        temporary.write_bytes(b"half a rep")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(folder / "drive.md", writer=broken)
    assert (folder / "drive.md").read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["drive.json", "drive.md", "drive.png"]


def test_time_table_per_policy(report):
    folder, _ = report
    timing = (folder / "drive.md").read_text().split("## Where the time went")[1]
    # checkpoint: render 1 s, policy mean(0, .25, .5, .75) = 0.375 s, 8 s episodes in 2 s wall = 4x
    assert "| `checkpoint` | 16.0 | 1.000 | 0.375 | 0.500 | 2.000 | 4.00 |" in timing


def test_policies_ordered_best_first(report):
    folder, _ = report
    overall = (folder / "drive.md").read_text().split("## Overall")[1].split("##")[0]
    order = [line.split("`")[1] for line in overall.splitlines() if line.startswith("| `")]
    assert order == ["expert", "checkpoint", "constant_velocity"]


def test_json_round_trips_with_nan_as_null(report):
    folder, _ = report
    loaded = json.loads((folder / "drive.json").read_text())  # strict JSON: NaN would not be written
    assert "NaN" not in (folder / "drive.json").read_text()
    assert loaded["summary"]["expert"]["all"]["first_collision_s"] == {"mean": None, "std": None, "episodes": 6}
    assert loaded["summary"]["checkpoint"]["jaywalker"]["pdms"] == {"mean": 0.5124, "std": 0.0301, "episodes": 6}
    assert loaded["rows"][1]["metrics"]["first_collision_s"] is None
    assert loaded["rows"][0]["metrics"]["first_collision_s"] == 2.5
    assert loaded["meta"]["seeds"] == [100, 101]


def test_json_takes_numpy_values(tmp_path):
    rows = [{"policy": "expert", "family": "route", "seed": np.int64(3), "index": 0, "latency_ms": np.float32(1.5),
             "metrics": {"driving_score": np.float64(0.5), "first_collision_s": np.float64("nan")}}]
    summary = {"expert": {"route": {"driving_score": _stats(np.float64(0.5), np.float64(0.0))},
                          "all": {"driving_score": _stats(0.5, 0.0)}}}
    write_report(tmp_path, summary, rows, {"seeds": np.array([3])})
    loaded = json.loads((tmp_path / "drive.json").read_text())
    assert loaded["rows"][0]["seed"] == 3 and loaded["rows"][0]["metrics"]["first_collision_s"] is None
    assert loaded["meta"]["seeds"] == [3]


def test_png_is_a_sensible_chart(report):
    folder, _ = report
    with Image.open(folder / "drive.png") as image:
        assert image.format == "PNG"
        width, height = image.size
        colours = len(np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0))
    assert 600 <= width <= 3000 and 400 <= height <= 2000
    assert colours > 20  # bars of three policies, error bars, text: not a blank canvas


def test_nothing_to_report_is_refused(tmp_path):
    with pytest.raises(ValueError, match="nothing to report"):
        write_report(tmp_path / "empty", {}, [], {})
    assert not (tmp_path / "empty").exists()


def test_fmt_keeps_differences_over_a_hundredth():
    assert fmt(0.5124) != fmt(0.5249) and fmt(0.5049) != fmt(0.4949)
    assert fmt(float("nan")) == "n/a" and fmt(None) == "n/a"


# ---------------------------------------------------------------------------------------------- clips


def _ground() -> GroundRaster:
    """120 m x 120 m of road with a sidewalk stripe at the left edge (cell 0.25 m), origin at (0, 0)."""
    classes = np.full((480, 480), SEG["road"], np.uint8)
    classes[:, :40] = SEG["sidewalk"]
    return GroundRaster(classes, np.zeros_like(classes, bool), (0.0, 0.0))


EGO_YAW = 0.7


def _frames(count=12, front=True) -> list:
    frames = []
    heading = np.array([math.cos(EGO_YAW), math.sin(EGO_YAW)])
    for t in range(count):
        ego = np.array([60.0, 60.0]) + heading * 0.5 * t
        ahead = ego + heading * 12.0
        image = np.zeros((12, 16, 3), np.uint8)
        image[:, :8] = (200, 30, 30)
        frames.append({"time_s": 0.1 * t, "front": image if front else None, "ego": (*ego, EGO_YAW),
                       "ego_size": (4.5, 1.9), "agents": np.array([[*ahead, EGO_YAW, 4.5, 1.9]]), "classes": ["car"],
                       "plan": ego + heading * np.arange(1, 7)[:, None] * 1.5, "route": ego + heading * np.arange(-40, 40)[:, None],
                       "title": "checkpoint lead_brake seed 100 ep 000"})
    return frames


def _bev(image: np.ndarray, camera_width: int) -> np.ndarray:
    return image[clips.TITLE_PIXELS:, camera_width:]


def test_bev_box_ahead_is_drawn_above_the_ego():
    frame = _frames(1)[0]
    image = clips.compose_frame(frame, _ground())
    camera_width = 512  # 12 x 16 front scaled to 384 tall
    assert image.shape == (clips.TITLE_PIXELS + clips.BEV_PIXELS, camera_width + clips.BEV_PIXELS, 3)
    bev = _bev(image, camera_width)
    centre, scale = clips.BEV_PIXELS // 2, clips.BEV_PIXELS / clips.BEV_METRES
    assert tuple(bev[centre + 5, centre]) == clips.EGO_RGB
    ahead_row = centre - int(12.0 * scale)
    assert tuple(bev[ahead_row, centre]) == clips.AGENT_RGB["car"]
    assert tuple(bev[centre + int(12.0 * scale), centre]) != clips.AGENT_RGB["car"]  # not mirrored behind
    assert tuple(bev[centre, centre - 40]) == clips.GROUND_RGB[SEG["road"]]


def test_bev_turns_with_the_ego():
    """The ego's left is the panel's left: a sidewalk at the world's small x lies to the left when heading +y."""
    frame = {**_frames(1)[0], "ego": (15.0, 60.0, math.pi / 2), "agents": np.zeros((0, 5)), "classes": [],
             "plan": None, "route": np.zeros((0, 2))}
    bev = clips.bev_panel(frame, _ground())
    scale = clips.BEV_PIXELS / clips.BEV_METRES
    centre = clips.BEV_PIXELS // 2
    left = centre - int(8.0 * scale)  # world x = 7 m: sidewalk (x < 10 m)
    right = centre + int(8.0 * scale)  # world x = 23 m: road
    assert tuple(bev[centre - 60, left]) == clips.GROUND_RGB[SEG["sidewalk"]]
    assert tuple(bev[centre - 60, right]) == clips.GROUND_RGB[SEG["road"]]


def test_camera_panel_is_nearest_upscaled_and_blind_is_grey():
    front = _frames(1)[0]["front"]
    panel = clips.camera_panel(front, 512)
    assert np.array_equal(panel, np.repeat(np.repeat(front, 32, axis=0), 32, axis=1))
    blind = clips.camera_panel(None, clips.BEV_PIXELS)
    assert blind.shape == (clips.BEV_PIXELS, clips.BEV_PIXELS, 3)
    grey = (blind == clips.NO_CAMERA_RGB).all(axis=2)
    assert grey.mean() > 0.9 and not grey.all()  # grey, with the words on it


def test_clip_decodes_to_its_frames(tmp_path):
    from stack.video import decode_h264

    path = clips.write_clip(tmp_path / "clips" / "episode.mp4", _frames(12), _ground(), fps=10)
    assert path == tmp_path / "clips" / "episode.mp4"
    assert [p.name for p in path.parent.iterdir()] == ["episode.mp4"]  # no temp file left
    video = decode_h264(path.read_bytes())
    assert video.shape == (12, clips.TITLE_PIXELS + clips.BEV_PIXELS, 512 + clips.BEV_PIXELS, 3)
    bev = _bev(video[6], 512).astype(int)
    centre, scale = clips.BEV_PIXELS // 2, clips.BEV_PIXELS / clips.BEV_METRES
    car = np.array(clips.AGENT_RGB["car"])
    assert np.abs(bev[centre - int(12.0 * scale), centre] - car).max() < 40
    assert np.abs(bev[centre + int(12.0 * scale), centre] - car).max() > 80


def test_blind_clip_has_the_grey_panel(tmp_path):
    from stack.video import decode_h264

    path = clips.write_clip(tmp_path / "blind.mp4", _frames(3, front=False), _ground(), fps=10)
    video = decode_h264(path.read_bytes())
    assert video.shape[1:] == (clips.TITLE_PIXELS + clips.BEV_PIXELS, 2 * clips.BEV_PIXELS, 3)
    camera = video[0, clips.TITLE_PIXELS + 10:clips.TITLE_PIXELS + 60, 10:100].astype(int)
    assert np.abs(camera - np.array(clips.NO_CAMERA_RGB)).max() < 12


def test_clip_refuses_no_frames(tmp_path):
    with pytest.raises(ValueError, match="no frames"):
        clips.write_clip(tmp_path / "x.mp4", [], _ground(), fps=10)
    assert not list(tmp_path.iterdir())


def test_ego_speed_from_the_ego_track():
    speeds = clips.ego_speeds(_frames(4))  # 0.5 m per 0.1 s
    assert np.allclose(speeds, 5.0)
    assert clips.ego_speeds([{**_frames(1)[0], "speed": 3.0}]) == [3.0]


def test_every_clip_listed_with_its_episode(tmp_path):
    """Clips given as a list with indices (the documented alternative): each lands on its episode's row."""
    meta = {**_meta(), "clips": [{"policy": "expert", "index": i, "file": f"clips/e{i}.mp4"} for i in range(4)]}
    write_report(tmp_path, _summary(), _rows(), meta)
    worst = (tmp_path / "drive.md").read_text().split("## Worst episodes")[1].split("##")[0]
    expert_rows = [line for line in worst.splitlines() if line.startswith("| `expert`")]
    assert len(expert_rows) == 4
    assert all(f"| {line.split(' | ')[1]} |" in line and f"`clips/e{line.split(' | ')[1]}.mp4`" in line
               for line in expert_rows)


def test_one_seed_shows_means_and_ties_are_not_bold(tmp_path):
    summary = {policy: {family: {key: _stats(0.25 if key == "ttc" else 0.5 + 0.1 * k, float("nan"), 1)
                                 for key, _, _ in COLUMNS} for family in ("route", "all")}
               for k, policy in enumerate(POLICIES)}
    write_report(tmp_path, summary, _rows(), {**_meta(), "seeds": [7]})
    text = (tmp_path / "drive.md").read_text()
    assert "one seed" in text and "± n/a" not in text
    row = next(line for line in text.split("## route")[1].splitlines() if line.startswith("| `constant_velocity`"))
    cells = row.split(" | ")
    assert cells[1] == "**0.700**"  # best driving score
    assert cells[[h for _, h, _ in COLUMNS].index("TTC") + 1] == "0.250"  # everyone ties: nothing to bold


def test_bev_skips_absent_agents_and_missing_plan_points():
    """Agents that have not spawned yet (NaN boxes) and NaN waypoints are left out, not a crash."""
    frame = _frames(1)[0]
    frame = {**frame, "agents": np.vstack([frame["agents"], np.full((1, 5), np.nan)]), "classes": ["car", "car"],
             "plan": np.vstack([frame["plan"], [np.nan, np.nan]]), "route": np.vstack([frame["route"], [np.nan, 0.0]])}
    bev = clips.bev_panel(frame, _ground())
    centre = clips.BEV_PIXELS // 2
    assert tuple(bev[centre - int(12.0 * clips.BEV_PIXELS / clips.BEV_METRES), centre]) == clips.AGENT_RGB["car"]


def test_contact_outlines_ego_and_agent_in_red():
    """A box overlapping the ego (a collision frame) is outlined in CONTACT_RGB, as is the ego; none otherwise."""
    frame = _frames(1)[0]
    heading = np.array([math.cos(EGO_YAW), math.sin(EGO_YAW)])
    touching = np.array([[*(np.array(frame["ego"][:2]) + heading * 4.0), EGO_YAW, 4.5, 1.9]])
    crash = {**frame, "agents": touching, "plan": None}
    assert clips.contacts(clips._ego_box(crash), touching).tolist() == [True]
    assert clips.contacts(clips._ego_box(frame), frame["agents"]).tolist() == [False]
    red = lambda panel: (panel == clips.CONTACT_RGB).all(axis=2).sum()
    assert red(clips.bev_panel(crash, _ground())) > 100
    assert red(clips.bev_panel({**frame, "plan": None}, _ground())) == 0


def test_clip_sheet_puts_each_clip_in_a_column_of_its_frames_at_the_given_times(tmp_path):
    """benchmarks/clip_sheet.py: the frames nearest each time, top to bottom, one clip per column, scaled."""
    from PIL import Image

    from benchmarks.clip_sheet import main as clip_sheet
    from stack.video import encode_h264

    shades = np.repeat(np.arange(0, 200, 10, dtype=np.uint8), 64 * 96 * 3).reshape(20, 64, 96, 3)  # frame k: grey 10 k
    for name, frames in (("a.mp4", shades), ("b.mp4", 255 - shades)):
        (tmp_path / name).write_bytes(encode_h264(frames, 10.0))
    out = tmp_path / "sheet.png"
    assert clip_sheet([str(tmp_path / "a.mp4"), str(tmp_path / "b.mp4"), "--seconds", "0.5,1.5", "--scale", "0.5",
                       "--out", str(out)]) == 0
    sheet = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert sheet.shape == (64, 96, 3)  # two 32-row frames per column, two 48-pixel columns
    for row, frame in ((8, 5), (40, 15)):  # 0.5 s and 1.5 s at 10 Hz: frames 5 and 15
        assert abs(sheet[row, 24].mean() - 10 * frame) < 8 and abs(sheet[row, 72].mean() - (255 - 10 * frame)) < 8
    assert clip_sheet([str(tmp_path / "missing.mp4"), "--out", str(out)]) == 2
