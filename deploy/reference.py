"""The pinned reference network: the network the stack ships, committed with its card and a replay of its outputs.

openpilot commits its driving models and replays them on every change; torchtitan keeps golden loss files. Here
`models/reference/tiny-drive/` holds the network `make drive-recipe` trains (`REFERENCE_DIR`):

- `model.safetensors`: its weights, with its resolved pipeline and hash in the safetensors header
  (`stack.checkpoint.model_file.save_safetensors_checkpoint`): every command that takes a checkpoint takes it,
  and it loads without unpickling anything;
- `replay.safetensors`: a few closed-loop frames it saw (images, ego status, command, odometry) and what it made of
  them (every output the plan is chosen from, and the plan itself, with and without its post-processing): `replay`
  runs today's code on them and names every difference beyond `TOLERANCE`;
- `card.json` / `card.md`: how it was trained (command, commit, CPU, wall time), every `stack eval` figure, the
  held-out closed-loop figures (mean and 90% interval over episodes, the network alone and with its post-processing),
  the post-processing it ships, and each reproduction (`reproduce`).

`stack reference pin` writes them, `stack reference replay` checks them, `stack reference reproduce` compares a new
training of the recipe with the card.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from stack.deploy.bundle import sha256_file
from stack.errors import StackError
from stack.safe_values import escaped
from stack.user_json import parse_json, read_json

REFERENCE_DIR = Path("models/reference/tiny-drive")
"""Where the pinned reference network lives, relative to the repository root."""
MODEL_FILE, REPLAY_FILE, CARD_JSON, CARD_MD = "model.safetensors", "replay.safetensors", "card.json", "card.md"
REPLAY_FAMILY, REPLAY_INDEX, REPLAY_FRAMES = "stopped_vehicle", 0, 3
"""The replayed frames: consecutive replans of this held-out episode (a standing car ahead), the first window where
the post-processing changes the plan (`choose_window`)."""
GUARD_EFFECT_M = 1.0
"""A window shows the guard at work when its plan and the network's own differ by more than this somewhere."""
SCORE_SLACK = 0.01
"""A window is kept only if its plans stay the same with guard.score this much higher or lower: no detection sits
at the threshold, where another CPU's rounding could flip it."""
TOLERANCE = {"rtol": 2e-3, "atol_share": 2e-3, "plan_m": 0.02}
"""A replayed output may differ from the pinned one by atol_share x the output's largest magnitude plus rtol x the
value (float kernels differ between the CPUs we run on: AVX2, AVX-512, AMX), a plan by plan_m metres per waypoint.
A changed weight, layer, decoder or guard rule moves them by far more."""
SEED_SPREAD_DS = 0.08
"""Driving score (and PDMS) a reproduction may differ by: the RMS difference between two training seeds of one
configuration on the held-out episodes (`stack.deploy.gates.closed_loop_budget`, the targets' budget)."""
HEAD_SPREADS = 3.0
"""A reproduced head figure may differ by this many of the recipe's run-to-run standard deviations
(`stack.metrics.bars.RECIPE`)."""
HEAD_FIGURES = {"detection/mAP": "detection", "detection/NDS": "nuscenes", "segmentation/mIoU": "segmentation",
                "depth/AbsRel": "depth", "planning/L2_at_3s": "planning"}
"""The head figures a reproduction compares, with the recipe figures whose spread it allows."""
CARD_FIGURES = ("detection/mAP", "detection/NDS", "detection/mATE", "detection/mASE", "detection/mAOE",
                "detection/mAVE", "segmentation/mIoU", "depth/AbsRel", "depth_road_users/AbsRel", "planning/L2_at_3s",
                "planning/baseline_ego_rollout/L2_at_3s", "planning/baseline_cv/L2_at_3s", "planning/departure_reproduced")
"""The `stack eval` figures card.md lists (card.json keeps every one)."""
NETWORK, ALONE = "checkpoint", "checkpoint alone"
"""The policy names of the pinned network's drive: with its post-processing, and alone (`stack drive`)."""


# ------------------------------------------------------------------ pin


def pin(checkpoint: str | Path, folder: Path, eval_metrics: Path, drive_json: Path, trained: dict, log=print) -> dict:
    """Write the pinned network from `checkpoint` into `folder`: weights, replay, card; returns the card."""
    from stack.checkpoint.model_file import load_model_checkpoint, save_safetensors_checkpoint
    from stack.config import pipeline_hash, pipeline_to_yaml

    pipeline, state_dict, meta = load_model_checkpoint(checkpoint)
    metrics, drive = _read_json(eval_metrics, "stack eval's metrics.json"), _read_json(drive_json, "drive.json")
    folder.mkdir(parents=True, exist_ok=True)
    text = pipeline_to_yaml(pipeline)
    save_safetensors_checkpoint(folder / MODEL_FILE, text, pipeline_hash(pipeline), state_dict,
                                extra={"pinned_from": str(checkpoint), **meta.get("extra", {})},
                                lineage={"dataset": meta["dataset"]} if meta.get("dataset") else None)
    # not its MLflow run: that store lives on the machine it trained on; the card keeps what the run said
    (folder / "pipeline.yaml").write_text(text)
    log(f"driving {REPLAY_FAMILY} #{REPLAY_INDEX} and choosing {REPLAY_FRAMES} frames to replay ...")
    start, frames, outputs = choose_window(folder / MODEL_FILE, capture_frames(folder / MODEL_FILE, pipeline))
    log(f"replaying replans {start}-{start + len(frames) - 1}")
    write_replay(folder / REPLAY_FILE, frames, outputs, start)
    card = card_record(folder, pipeline, metrics, drive, trained)
    write_card(folder, card)
    log(f"pinned {checkpoint} -> {folder} ({(folder / MODEL_FILE).stat().st_size / 1e6:.1f} MB weights)")
    return card


def _read_json(path: Path, what: str) -> dict:
    return read_json(path, what, "Write it again with the stack command that makes it.")


def capture_frames(model_path: Path, pipeline) -> list[dict]:
    """Every replan of the held-out episode (REPLAY_FAMILY, REPLAY_INDEX), driven by the network with its
    post-processing: each frame's policy inputs and the ego's odometry."""
    from stack.deploy.network_policies import CheckpointPolicy, checkpoint_spec, guard_spec, odometry
    from stack.kinematics import previous_pose
    from stack.sim.episode import run_episode
    from stack.sim.policies import Policy
    from stack.sim.recording import past_positions
    from stack.sim.scenarios import build_world, episode_specs

    spec = checkpoint_spec(NETWORK, str(model_path), guard=guard_spec(pipeline.guard))
    inner, frames = CheckpointPolicy(spec, pipeline.model.planning_steps, pipeline), []

    class Recording(Policy):
        uses_cameras = True

        def plan(self, observation):
            o = odometry(observation)
            frames.append({"images": np.ascontiguousarray(observation.images.transpose(0, 3, 1, 2))[None],
                           "ego_status": observation.ego_status[None].astype(np.float32),
                           "command": np.array([observation.command], np.int64),
                           "previous_pose": previous_pose(past_positions(observation.world))[None].astype(np.float32),
                           "odometry": np.array([o.time_s, o.x, o.y, o.yaw, o.speed], np.float64)})
            return inner.plan(observation)

    families = list(pipeline.drive.scenarios)
    episode = [e for e in episode_specs(families, len(families) * (REPLAY_INDEX + 1), [0], pipeline.drive.episode_seconds)
               if e.family == REPLAY_FAMILY][REPLAY_INDEX]
    world = build_world(episode, pipeline.data.world, 1.0 / pipeline.drive.sim_hz)
    run_episode(world, Recording(spec, pipeline.model.planning_steps), pipeline.drive, pipeline.data.rig)
    return frames


def choose_window(model_path: Path, frames: list[dict]) -> tuple[int, list[dict], list[dict]]:
    """(first replan, frames, their outputs) of the first REPLAY_FRAMES consecutive replans whose plans the
    post-processing changes and that no nearby guard score would change; else the first window."""
    from dataclasses import replace as changed

    from stack.checkpoint.model_file import load_model_checkpoint

    guard = load_model_checkpoint(model_path)[0].guard
    first = None
    for start in range(max(1, len(frames) - REPLAY_FRAMES + 1)):
        window = frames[start:start + REPLAY_FRAMES]
        outputs = replay_outputs(model_path, window)
        first = first or (start, window, outputs)
        works = any(np.abs(o["plan"] - o["plan_alone"]).max() > GUARD_EFFECT_M for o in outputs)
        steady = all(np.array_equal(o["plan"], p["plan"]) for shift in (-SCORE_SLACK, SCORE_SLACK)
                     for o, p in zip(outputs, replay_outputs(model_path, window, changed(guard, score=guard.score + shift))))
        if works and steady:
            return start, window, outputs
    return first


def replay_outputs(model_path: Path, frames: list[dict], guard=None) -> list[dict]:
    """What today's code makes of the frames, in order (a temporal network fuses each frame's predecessor): every
    output the plan is chosen from, and the plan with the pinned post-processing ("plan"; `guard` instead of the
    pinned guard when given) and without it ("plan_alone")."""
    import torch

    from stack.checkpoint.model_file import load_network
    from stack.deploy.network_policies import rig_geometry
    from stack.models.plan_guard import Odometry
    from stack.models.post_processing import GUARD_READS, PlanPostProcessing
    from stack.pipeline import GuardConfig

    pipeline, net = load_network(model_path, needs_planner=True)
    geometry = rig_geometry(net, pipeline.data.rig)
    guarded, alone = PlanPostProcessing(pipeline, guard), PlanPostProcessing(pipeline, GuardConfig())
    memory, found = None, []
    for frame in frames:
        pose = None if memory is None else torch.from_numpy(frame["previous_pose"])
        with torch.inference_mode():
            out = net(torch.from_numpy(frame["images"]), torch.from_numpy(frame["ego_status"]),
                      torch.from_numpy(frame["command"]), geometry, None, memory, pose)
        memory = out.get("bev_memory")
        outputs = {name: out[name].float().numpy() for name in GUARD_READS}
        odometry = Odometry(*(float(v) for v in frame["odometry"]))
        found.append({**outputs, "plan": guarded.choose(outputs, odometry), "plan_alone": alone.choose(outputs)})
    return found


def write_replay(path: Path, frames: list[dict], outputs: list[dict], start: int) -> None:
    """The frames and the pinned outputs as one safetensors file (no pickle), with TOLERANCE in its header."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for i, (frame, out) in enumerate(zip(frames, outputs)):
        tensors.update({f"frame{i}.input.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in frame.items()})
        tensors.update({f"frame{i}.output.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()})
    header = {"frames": len(frames), "first_replan": start,
              "episode": {"family": REPLAY_FAMILY, "index": REPLAY_INDEX, "seed": 0},
              "tolerance": TOLERANCE}
    save_file(tensors, str(path), metadata={"stack": json.dumps(header)})


def read_replay(path: Path) -> tuple[list[dict], list[dict], dict]:
    """(frames, pinned outputs, header) of a replay file, or a StackError saying what is wrong with it."""
    from safetensors import safe_open

    again = "Pin the reference network again (`make pin-reference`)."
    try:
        with safe_open(str(path), framework="np") as handle:
            metadata = handle.metadata() or {}
            if "stack" not in metadata:
                raise StackError(f"{escaped(str(path))}: a safetensors file without the `stack` header a replay "
                                 f"file carries. {again}")
            header = parse_json(metadata["stack"], escaped(str(path)), "a replay file `stack reference pin` wrote",
                                again)
            names = list(handle.keys())
            count = header.get("frames")
            if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= len(names):
                raise StackError(f"{escaped(str(path))}: its header names {escaped(repr(count)[:40])} frames; a replay "
                                 f"file holds 1 to its {len(names)} arrays' worth. {again}")
            arrays = {key: handle.get_tensor(key) for key in names}
    except StackError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to read means the same: no replay here
        raise StackError(f"{escaped(str(path))}: not a replay file `stack reference pin` wrote ({type(exc).__name__}: "
                         f"{escaped(str(exc)[:160])}). {again}") from None
    frames, outputs = [{} for _ in range(count)], [{} for _ in range(count)]
    for key, value in arrays.items():
        index, kind, name = _replay_key(key, count, path, again)
        (frames if kind == "input" else outputs)[index][name] = value
    return frames, outputs, header


def _replay_key(key: str, frames: int, path: Path, again: str) -> tuple[int, str, str]:
    """(frame index, "input"/"output", name) of a replay array's key `frame{i}.{kind}.{name}`."""
    parts = key.split(".", 2)
    index = parts[0].removeprefix("frame")
    if len(parts) != 3 or parts[1] not in ("input", "output") or not re.fullmatch(r"[0-9]{1,9}", index) \
            or int(index) >= frames:
        raise StackError(f"{escaped(str(path))}: array {escaped(key[:80])} is not frame{{0..{frames - 1}}}.input.NAME "
                         f"or .output.NAME. {again}")
    return int(index), parts[1], parts[2]


# --------------------------------------------------------------- replay


def replay(folder: Path = REFERENCE_DIR) -> list[str]:
    """Every difference between what today's code makes of the pinned frames and what the pinned network made of
    them, beyond TOLERANCE ([] when none): a changed model, decoder or plan guard shows here."""
    frames, pinned, _ = read_replay(folder / REPLAY_FILE)
    return compare_outputs(pinned, replay_outputs(folder / MODEL_FILE, frames))


def compare_outputs(pinned: list[dict], found: list[dict]) -> list[str]:
    """Differences beyond TOLERANCE between two replays, output by output, frame by frame."""
    problems = []
    for i, (want, got) in enumerate(zip(pinned, found)):
        for name, reference in want.items():
            value = got.get(name)
            if value is None or np.shape(value) != np.shape(reference):
                problems.append(f"frame {i} {name}: expected shape {np.shape(reference)}, found "
                                f"{'nothing' if value is None else np.shape(value)}")
                continue
            error = np.abs(np.asarray(value, np.float64) - np.asarray(reference, np.float64))
            if name.startswith("plan") and name != "plan_scores" and name != "plan_trajectories":
                allowed = np.full_like(error, TOLERANCE["plan_m"])
            else:
                scale = float(np.abs(reference).max()) if np.size(reference) else 0.0
                allowed = TOLERANCE["atol_share"] * scale + TOLERANCE["rtol"] * np.abs(np.asarray(reference, np.float64))
            if not np.all(error <= allowed) or not np.isfinite(error).all():
                worst = int(np.nanargmax(error - allowed)) if np.isfinite(error).all() else 0
                problems.append(f"frame {i} {name}: differs by {error.flat[worst]:.3g} where {allowed.flat[worst]:.3g} "
                                f"is allowed ({int((error > allowed).sum())} of {error.size} values beyond)")
    if len(found) != len(pinned):
        problems.append(f"{len(found)} frames replayed, {len(pinned)} pinned")
    return problems


# ----------------------------------------------------------------- card


def card_record(folder: Path, pipeline, metrics: dict, drive: dict, trained: dict) -> dict:
    """card.json: the network, how it was trained, its eval figures, its held-out drive, its post-processing."""
    from stack.config import pipeline_hash
    from stack.models.post_processing import post_processing_record

    return {"network": {"file": MODEL_FILE, "sha256": sha256_file(folder / MODEL_FILE),
                        "pipeline_hash": pipeline_hash(pipeline), "replay": REPLAY_FILE,
                        "replay_sha256": sha256_file(folder / REPLAY_FILE)},
            "trained": trained, "eval": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "closed_loop": closed_loop_summary(drive), "post_processing": post_processing_record(pipeline),
            "reproductions": []}


def closed_loop_summary(drive: dict) -> dict:
    """Per policy of a drive.json: mean and 90% bootstrap interval over episodes of DS, PDMS, collisions and route
    completion; the episodes, and the bar's comparisons of the network with and without post-processing."""
    from stack.metrics.driving import bootstrap_mean

    rows, meta = drive.get("rows") or [], drive.get("meta") or {}
    policies = {}
    for name in dict.fromkeys(r["policy"] for r in rows):
        own = [r["metrics"] for r in rows if r["policy"] == name]
        policies[name] = {metric: bootstrap_mean([m[metric] for m in own]) for metric in
                          ("driving_score", "pdms", "collisions", "route_completion")}
    return {"episodes": meta.get("episodes"), "split": meta.get("split"), "seeds": meta.get("seeds"),
            "scenarios": meta.get("scenarios"), "cpu": meta.get("cpu"), "latency": meta.get("latency"),
            "policies": policies, "bar": meta.get("bar")}


def write_card(folder: Path, card: dict) -> None:
    (folder / CARD_JSON).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
    (folder / CARD_MD).write_text(card_markdown(card))


def card_markdown(card: dict) -> str:
    """card.md: the card for people (card.json holds every figure)."""
    trained, loop, post = card["trained"], card["closed_loop"], card["post_processing"]
    lines = ["# The reference network: tiny-drive", "",
             "The network `make drive-recipe` trains, pinned: `model.safetensors` (weights + resolved pipeline, no "
             "pickle), `replay.safetensors` (closed-loop frames and its outputs on them), this card. `make test` "
             "deploys it for ci-cpu and orin and drives it (`stack reference replay` checks the replay).", "",
             "## Trained", "", f"- Command: `{trained.get('command', '?')}`",
             f"- Commit {trained.get('commit', '?')}, {trained.get('date', '?')}; CPU: {trained.get('cpu', '?')}; "
             f"wall time {trained.get('wall_s', float('nan')) / 60:.1f} min ({trained.get('steps', '?')} steps, "
             f"{trained.get('precision', '?')})", f"- Weights sha256 {card['network']['sha256'][:16]}…, pipeline hash "
             f"{card['network']['pipeline_hash']}", "", "## `stack eval` (validation split; every figure in card.json)", "",
             "| figure | value |", "|---|---:|"]
    lines += [f"| {key} | {card['eval'][key]:.4g} |" for key in CARD_FIGURES if key in card["eval"]]
    lines += ["", f"## Closed loop: {loop.get('episodes')} held-out episodes ({loop.get('split')} split, seeds "
              f"{loop.get('seeds')}), driven on {loop.get('cpu')}", "",
              "Mean and 90% bootstrap interval over episodes. `checkpoint` drives with the post-processing below, "
              "`checkpoint alone` is the same network choosing its planner's best candidate.", "",
              "| policy | driving score | PDMS | at-fault collisions / episode | route completion |", "|---|---|---|---|---|"]
    for name, figures in loop["policies"].items():
        cells = [f"{f['mean']:.3f} [{f['low']:.3f}, {f['high']:.3f}]" for f in
                 (figures[m] for m in ("driving_score", "pdms", "collisions", "route_completion"))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, bar in (loop.get("bar") or {}).items():
        if bar.get("comparisons"):
            gains = "; ".join(f"{c['metric']} vs {c['baseline']} {c['gain']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"
                              for c in bar["comparisons"])
            verdict = ("within" if bar["passed"] else "below") if bar.get("information") else \
                ("PASS" if bar["passed"] else "FAIL")
            lines.append(f"\n- Bar, `{name}`: **{verdict}** ({gains})")
    lines += ["", "## Post-processing it ships", "", f"- Plan guard: `{json.dumps(post['guard'], sort_keys=True)}`",
              f"- Detection decoding it reads: `{json.dumps(post['decoding'], sort_keys=True)}`", "",
              "## Reproductions (`make drive-recipe` against this card)", ""]
    if not card["reproductions"]:
        lines.append("- none yet")
    for r in card["reproductions"]:
        lines.append(f"- {r['date']} on {r['cpu']} (commit {r['commit']}): **{r['verdict']}**; " + "; ".join(r["lines"]))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ reproduce


def reproduce(folder: Path, eval_metrics: Path, drive_json: Path) -> dict:
    """A new training of the recipe against the card: {"passed", "lines"}: closed-loop DS and PDMS of the network
    with its post-processing within SEED_SPREAD_DS of the card's, each head figure within HEAD_SPREADS of the
    recipe's run-to-run spread."""
    from stack.metrics.bars import RECIPE

    card = _read_json(folder / CARD_JSON, "the reference network's card.json")
    metrics, drive = _read_json(eval_metrics, "stack eval's metrics.json"), _read_json(drive_json, "drive.json")
    found = closed_loop_summary(drive)["policies"].get(NETWORK)
    if found is None:
        raise StackError(f"{drive_json}: no policy {NETWORK!r} drove; drive the new checkpoint alone "
                         f"(`stack drive CHECKPOINT ...`) to compare it with the card")
    lines, passed = [], True
    for metric in ("driving_score", "pdms"):
        pinned, new = card["closed_loop"]["policies"][NETWORK][metric]["mean"], found[metric]["mean"]
        ok = abs(new - pinned) <= SEED_SPREAD_DS
        passed &= ok
        lines.append(f"{metric} {new:.3f} vs pinned {pinned:.3f} ({new - pinned:+.3f}; allowed ±{SEED_SPREAD_DS:g}: "
                     f"{'ok' if ok else 'OUT'})")
    for key, head in HEAD_FIGURES.items():
        pinned, new = card["eval"].get(key), metrics.get(key)
        if not isinstance(pinned, (int, float)) or not isinstance(new, (int, float)) or not math.isfinite(new):
            passed = False
            lines.append(f"{key}: missing")
            continue
        allowed = HEAD_SPREADS * RECIPE[head].spread
        ok = abs(new - pinned) <= allowed
        passed &= ok
        lines.append(f"{key} {new:.3f} vs pinned {pinned:.3f} (allowed ±{allowed:.3f}: {'ok' if ok else 'OUT'})")
    return {"passed": bool(passed), "lines": lines}


def record_reproduction(folder: Path, verdict: dict, trained: dict) -> None:
    """Append a reproduction's verdict to the card (card.json and card.md)."""
    card = _read_json(folder / CARD_JSON, "the reference network's card.json")
    card["reproductions"].append({"date": trained.get("date"), "cpu": trained.get("cpu"), "commit": trained.get("commit"),
                                  "verdict": "PASS" if verdict["passed"] else "FAIL", "lines": verdict["lines"]})
    write_card(folder, card)

