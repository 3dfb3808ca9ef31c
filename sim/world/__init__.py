"""stack.sim.world: the procedural driving world, shared by `stack data make` and `stack drive`.

- `roads`: the town (junction arms, painted ground raster, buildings, trees, semantic classes).
- `traffic`: routes and road users stepped with IDM car following, junction yielding and
  pedestrians; the same rules move traffic in recorded scenes and in closed loop.
- `scene`: one recorded scene (the expert drives the ego) and the labels of its key frames.
- `render`, `frame`: the ray-cast renderer and one multi-camera frame with its labels.
- `interactive`: the same town, traffic and renderer stepped in time with the ego driven
  from outside (by a policy in `stack.sim`).

Imports run one way: `stack.sim.world` imports `stack.pipeline`, `stack.rig` and
`stack.kinematics` only; the shard writer (`stack.data.make`) and the closed loop import it,
never the other way round, and no loader code depends on it.
"""
