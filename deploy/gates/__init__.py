"""The gates a deploy bundle must pass; `stack.deploy.orchestrate` runs them in order.

- `accuracy`: INT8 against fp32, head by head, on validation frames (scored by `head_scores`).
- `fps`: the latency budget of the target's cameras, measured here or predicted by `stack.deploy.latency`.
- `closed_loop`: the INT8 model may not drive worse than the fp32 model (episodes in `stack.sim`).
"""
