"""Is motion in a temporal network's BEV at all? A probe on the frozen memory of a trained k = 1 network.

`stack eval` shows how much of its velocity a temporal network reads from the previous key frame (a few percent
on the tiny preset: docs/log/2026-11-27_velocity-from-one-frame.md). That leaves two
explanations: the fused BEV holds the motion and the heads do not learn to use it, or the BEV does not hold it.
A probe tells them apart (Alain & Bengio 2016, "Understanding intermediate layers using linear classifier
probes"): the network's weights stay frozen; around every moving road user's centre a patch of the BEV memory
(`BevNet.memory`) is cut from the current frame and from the previous one warped into the current ego frame
(`stack.models.temporal`); small regressors learn the true velocity from the current patch alone and from both,
on the train split, and are scored on val (sequence starts left out: their previous frame is the frame itself).
What the previous patch removes from the probe's error is what the memory holds about motion, whatever the heads
make of it. The error is split along the ray from the ego and across it (a lift-splat BEV smears a thing along
its camera ray by the depth error; its bearing is sharp).

    python benchmarks/motion_probe.py runs/tiny-drive/train/model.pt
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

MOVING_MPS = 1.0
PATCH_RADIUS = 2
"""Cells each side of the centre cell: a 5 x 5 patch covers a car moving 4 m/s for 0.5 s in any direction."""


def patches(net, pipeline, split: str) -> dict[str, np.ndarray]:
    """current / previous (N, C * P * P) patches of the BEV memory at moving road users' centres, their velocity
    (N, 2) and position (N, 2), over the non-first frames of `split`."""
    import torch.nn.functional as F

    from stack.data import build_loader
    from stack.metrics.motion import MotionMetric
    from stack.models.temporal import warp_previous_bev

    bev, r = pipeline.model.bev, PATCH_RADIUS
    ranges = (tuple(bev.x_range), tuple(bev.y_range))
    found: dict[str, list] = {"current": [], "previous": [], "velocity": [], "position": []}
    loader = build_loader(pipeline, split, rank=0, world_size=1, shuffle=False, augment=False)
    for step, batch in enumerate(loader):
        with torch.no_grad():
            geometry = net.geometry(batch.intrinsics, batch.cam_to_ego)
            current = F.pad(net.memory(batch.images, geometry), (r, r, r, r))
            previous = net.memory(batch.previous_images, geometry)
            previous = F.pad(warp_previous_bev(previous, batch.previous_pose, None, *ranges), (r, r, r, r))
        starts = torch.tensor([torch.equal(now, then) for now, then in zip(batch.images, batch.previous_images)])
        cells = MotionMetric(bev).centre_cells(batch.boxes)
        moving = batch.boxes[..., 7:9].norm(dim=-1) > MOVING_MPS
        for j, k in ((batch.box_labels >= 0) & moving & (cells[..., 0] >= 0) & ~starts[:, None]).nonzero().tolist():
            x, y = cells[j, k].tolist()
            found["current"].append(current[j, :, x:x + 2 * r + 1, y:y + 2 * r + 1].flatten().numpy())
            found["previous"].append(previous[j, :, x:x + 2 * r + 1, y:y + 2 * r + 1].flatten().numpy())
            found["velocity"].append(batch.boxes[j, k, 7:9].numpy())
            found["position"].append(batch.boxes[j, k, :2].numpy())
        print(f"\r{split}: batch {step + 1}/{len(loader)}, {len(found['velocity'])} moving road users", end="",
              flush=True)
    print()
    return {name: np.asarray(rows, np.float32) for name, rows in found.items()}


def errors(predicted: np.ndarray, velocity: np.ndarray, position: np.ndarray) -> tuple[float, float, float]:
    """Mean velocity error: whole, along the ray from the ego, across it (m/s)."""
    along = position / np.maximum(np.linalg.norm(position, axis=1, keepdims=True), 1e-6)
    across = np.stack([-along[:, 1], along[:, 0]], axis=1)
    error = predicted - velocity
    return (float(np.linalg.norm(error, axis=1).mean()), float(np.abs((error * along).sum(1)).mean()),
            float(np.abs((error * across).sum(1)).mean()))


def mlp_probe(train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray, seed: int, epochs: int) -> np.ndarray:
    """A two-layer MLP (256 wide, dropout 0.2, AdamW, L1 as the detection head's velocity loss) on standardised
    features; its predictions for `val_x`."""
    torch.manual_seed(seed)
    x, val = torch.from_numpy(train_x), torch.from_numpy(val_x)
    mean, std = x.mean(0), x.std(0) + 1e-6
    x, val, y = (x - mean) / std, (val - mean) / std, torch.from_numpy(train_y)
    probe = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 256), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    optimizer = torch.optim.AdamW(probe.parameters(), 1e-3, weight_decay=1e-2)
    for _ in range(epochs):
        probe.train()
        for rows in torch.randperm(len(x)).split(256):
            loss = (probe(x[rows]) - y[rows]).abs().sum(1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    probe.eval()
    with torch.no_grad():
        return probe(val).numpy()


def main() -> None:
    from stack.checkpoint.model_file import load_network
    from stack.errors import StackError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="model.pt of a network with model.temporal_frames=1")
    parser.add_argument("--seeds", type=int, default=2, help="probes trained per input (their spread is the noise)")
    parser.add_argument("--epochs", type=int, default=60)
    args = parser.parse_args()
    try:
        pipeline, net = load_network(args.checkpoint)
    except StackError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if not pipeline.model.temporal_frames:
        print(f"error: {args.checkpoint} fuses no previous frame (model.temporal_frames=0): probe a temporal network "
              f"(model.temporal_frames=1)", file=sys.stderr)
        raise SystemExit(2)
    net.eval()
    train, val = patches(net, pipeline, "train"), patches(net, pipeline, "val")
    print(f"{len(train['velocity'])} moving road users in train, {len(val['velocity'])} in val (mean speed "
          f"{np.linalg.norm(val['velocity'], axis=1).mean():.2f} m/s)\n")
    print("| probe input | velocity error, val (m/s) | along the ray | across it |\n|---|---|---|---|")
    zero = errors(np.zeros_like(val["velocity"]), val["velocity"], val["position"])
    print("| none (says everything stands) | %.3f | %.3f | %.3f |" % zero)
    inputs = {"current patch": lambda d: d["current"],
              "current + warped previous patch": lambda d: np.hstack([d["current"], d["previous"]])}
    for name, features in inputs.items():
        for seed in range(args.seeds):
            predicted = mlp_probe(features(train), train["velocity"], features(val), seed, args.epochs)
            print(f"| {name}, probe seed {seed} | %.3f | %.3f | %.3f |" % errors(predicted, val["velocity"],
                                                                             val["position"]), flush=True)


if __name__ == "__main__":
    main()
