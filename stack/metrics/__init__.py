"""Metrics for the four tasks, each accumulated over batches (`update`, then `compute`).

They live in `stack` (not `stack.models`) because train and deploy both evaluate
with them and they must not depend on the network: they take plain tensors
(decoded boxes, depth maps, class maps, trajectories) and ground truth from a Batch.
Every metric also reports the trivial baseline it must beat, and follows the
published reference it is named after (tests check each against an outside oracle).
`driving` scores closed-loop episodes (nuPlan, NAVSIM PDMS, CARLA driving score) from numpy traces.
"""
