"""stack.sim: the simulator. The rendered world, its privileged expert, and the closed loop that drives in it.

- `world/`: the town, traffic (IDM, junction yielding, pedestrians), the recorded scenes whose ego the
  expert drives, the ray-cast renderer, and the interactive world stepped with the ego driven from outside
  (`world.interactive.InteractiveWorld`; its `expert_plan` is the privileged expert). `stack data make`
  renders datasets through it.
- `scenarios`: seeded, held-out scenario families (route, lead_brake, stopped_vehicle, zebra_crossing,
  jaywalker, unprotected_turn, cut_in) built into InteractiveWorlds.
- `vehicle`: the kinematic bicycle ego and the tracker that follows a plan.
- `policies`: the policy interface, the expert and the blind baselines (constant velocity, ego rollout).
- `episode`: one episode: replanning at the camera rate, latency in the loop, the trace it leaves.
- `drive`: episodes in worker processes, scored with `stack.metrics.driving`; what `stack drive` runs.
- `drive_report`, `drive_clips`: drive.md / drive.json / drive.png and MP4 clips of the worst episodes.
- `bench`: the closed loop's speed (simulated seconds per wall second, where the time goes).

Imports run one way: `stack.sim` imports only the ground floor (`stack.pipeline`, `stack.rig`,
`stack.kinematics`, `stack.metrics`, `stack.video`, `stack.errors`); `stack.data`, `stack.train` and
`stack.deploy` import it. A network drives through the policy interface: the checkpoint and bundle
policies live with their runtimes in `stack.deploy.network_policies`, and the closed-loop deploy gate in
`stack.deploy.gates.closed_loop` (tests/stack/test_layering.py checks the direction).
"""
