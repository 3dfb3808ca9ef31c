"""Closed-loop evaluation (issue 15): the trained and the deployed network drive in the rendered world.

- `scenarios`: seeded, held-out scenario families (route, lead_brake, stopped_vehicle, zebra_crossing,
  jaywalker, unprotected_turn, cut_in) built into `stack.sim.world.interactive.InteractiveWorld`s.
- `vehicle`: the kinematic bicycle ego and the tracker that follows a plan.
- `policies`: the network (checkpoint or bundle) and the baselines behind one interface.
- `episode`: one episode: replanning at the camera rate, latency in the loop, the trace it leaves.
- `evaluate`: episodes in worker processes, scored with `stack.metrics.driving`.
- `gate`: the deploy gate (INT8 must not drive worse than fp32 by more than the target's budget).
- `report`, `clips`: drive.md / drive.json / drive.png and MP4 clips of the worst episodes.
- `bench`: `stack bench drive` (simulated seconds per wall second, where the time goes).

Imports run one way: this package imports `stack.sim.world`, `stack.deploy.runner`, `stack.models`
and `stack.metrics`; none of them imports it.
"""
