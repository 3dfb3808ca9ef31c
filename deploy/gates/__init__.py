"""The gates a deploy bundle must pass; `stack.deploy.orchestrate` runs them in order.

- `closed_loop`: the INT8 model may not drive worse than the fp32 model (episodes in `stack.sim`).
"""
